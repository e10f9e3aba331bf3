"""Where a cuda-backend step spends its device time: per-kernel totals for prefill and decode steps of the
reference shapes (bench/engine.py SHAPES), recorded with CUPTI through torch.profiler (it sees every kernel of the process,
Numba's and cuBLAS's, including those replayed from CUDA graphs). Writes JSON; prints the top kernels per
scenario with the device-busy share of the wall time (the rest is host time: launches, syncs, Python).

    python bench/profile_step.py --out out/ [--shapes mixtral-shape] [--top 12]
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import SHAPES, build_hf, write_colibri  # noqa: E402

SCENARIOS = (("prefill", 1, 512), ("prefill", 16, 128), ("decode", 1, 128), ("decode", 16, 128),
             ("decode", 64, 128))


def short_name(name: str) -> str:
    """Numba's Itanium-mangled kernel names (_ZN<len><module>...<len><function>B...) -> the function name;
    other names (cuBLAS) cut to 60 characters."""
    if not name.startswith("_ZN"):
        return name[:60]
    parts, i = [], 3
    while i < len(name) and name[i].isdigit():
        digits = re.match(r"\d+", name[i:]).group()
        i += len(digits)
        parts.append(name[i:i + int(digits)])
        i += int(digits)
    return parts[-1] if parts else name[:60]


def profile(fn, repeats: int) -> tuple[dict, float]:
    import torch
    from torch.profiler import ProfilerActivity
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / repeats
    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[short_name(event.name)]
            entry[0] += event.device_time_total / repeats
            entry[1] += 1 / repeats
    return dict(totals), wall * 1e6


def run_shape(name: str, workdir: Path, top: int) -> dict:
    import torch
    from common.model_format import ModelDir
    from expert_service.config import EngineConfig
    from expert_service.engine import Engine, PrefillInput
    from expert_service.sampling import SamplingParams
    family, params = SHAPES[name]
    hf = build_hf(family, params)
    model_dir = write_colibri(hf, workdir / name)
    del hf
    torch.cuda.empty_cache()
    engine = Engine(ModelDir.open(model_dir, verify=False),
                    EngineConfig(backend="cuda", kv_block_size=16, kv_cache_tokens=64 * 512,
                                 max_batch_tokens=2048, max_batch_size=64))
    rng = np.random.default_rng(0)
    vocab = params["vocab_size"]
    results = {}
    for kind, b, n in SCENARIOS:
        if kind == "prefill":
            chunks = [PrefillInput(1000 + i, rng.integers(0, vocab, n), SamplingParams(), True) for i in range(b)]

            def fn(chunks=chunks):
                engine.step(chunks)
                engine.clear()
        else:
            ids = list(range(b))
            for start in range(0, b, 16):
                engine.step([PrefillInput(i, rng.integers(0, vocab, n), SamplingParams(), True)
                             for i in ids[start:start + 16]])
            for _ in range(3):
                engine.step(decode_ids=ids)

            def fn(ids=ids):
                engine.step(decode_ids=ids)
        totals, wall_us = profile(fn, 3 if kind == "prefill" else 10)
        if kind == "decode":
            engine.clear()
        busy = sum(t for t, _ in totals.values())
        key = f"{kind}_{b}x{n}"
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
        results[key] = {"wall_us": wall_us, "device_busy_us": busy,
                        "kernels": {k: {"us": t, "launches": c} for k, (t, c) in ranked}}
        print(f"\n{name} {key}: wall {wall_us:.0f} us, device busy {busy:.0f} us ({busy / wall_us:.0%})")
        for k, (t, c) in ranked[:top]:
            print(f"  {t:9.1f} us  {c:6.1f}x  {k}")
    engine.decoder.close()
    shutil.rmtree(model_dir, ignore_errors=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--workdir", default="/dev/shm/colibri-profile")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.shapes.split(","):
        results[name] = run_shape(name, Path(args.workdir), args.top)
        (out_dir / "profile_step.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
