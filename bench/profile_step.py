"""Where a cuda-backend step spends its device time: per-kernel totals of prefill and decode steps of the
reference shapes (bench/engine.py SHAPES), recorded with CUPTI through torch.profiler (it sees every kernel of
the process, Numba's and cuBLAS's, including those replayed from CUDA graphs), for several variants of the
decoder in the same run:

- fused:   every CudaOptions field as shipped (rope_kv_write, qk_norm_rope_kv_write, moe_combine_rmsnorm, and
           the paths before them);
- unfused: fused_rope_kv, fused_qk_norm and fused_combine_norm off (rope + kv_write, the q/k norms as rmsnorm
           launches, combine + rmsnorm);
- unfused_qk_norm: fused, with the per-head q/k norms as two rmsnorm launches before rope_kv_write
           (fused_qk_norm off);
- lut:     fused, on an engine with routing=lut fed a uniform random routing plan every step (gate_planned);
- tiled_attention: fused, with decode attention on attention_decode_tiled (mma_decode_attention off);
- untiled_attention: fused, with decode attention on attention_decode (mma_ and tiled_decode_attention off);
- baseline: unfused and also fused_router, greedy_split, mma_ and tiled_decode_attention off;
- in_turn_waves: fused, expert-cache waves of every slot, copies and kernels in turn (pipelined_waves off);
- moe_ffn_waves: fused, bf16 expert-cache waves on moe_ffn's CUDA-core kernels (cached_mma off);
- in_order_dequant: fused, 8-bit per-expert cuBLAS steps widening and running each group in turn
           (overlap_dequant off).
- l2_prefetch: fused, decode steps prefetching weights into L2 a kernel or two ahead (cuda/l2_warm.py).
- mma_sync_experts: fused, grouped-MMA steps on the mma.sync kernels at every size (wgmma_experts off: on sm_90
           steps of 96+ rows per expert otherwise take the warpgroup-MMA kernels).

fused / unfused / unfused_qk_norm / baseline / tiled_attention / untiled_attention share one
engine and the same sequences (CudaDecoder.set_options between variants drops the captured graphs, so each
variant's graphs are its own);
lut needs its own engine. Writes profile_step.json (per shape, variant and
scenario: wall, device busy, every kernel's time and launches per step; and per scenario the fused-vs-unfused
differences) and prints the top kernels.
Weights are random bf16 written straight into a Colibri model directory (no transformers needed; one random
pool reused across tensors, fresh values for the routers so routing stays uniform); `--expert-dtype int8|fp8`
writes the experts in that dtype instead (bench/random_model.py), `int8+head+attn` and the other bench/engine.py
formats the LM head and attention projections too. `--cache-slots N` runs the engines with the
expert cache at N slots per MoE layer (`--prefetch` none by default; with plan, every step carries a uniform random
routing plan, as lut's, so the plan prefetch runs: at chance on random routing, but at its full cost a step).
`--host-profile` also records where the
host's time goes in each scenario: Python's cProfile over the same steps, the top functions by own time and the
calls a step (large steps wait on the host's launches: wall well above device busy); `--host-timeline` marks, in
wall-clock order and without cProfile's overhead, the host's parts of one step (bench/host_timeline.py).

    python bench/profile_step.py --out out/ [--shapes mixtral-shape] [--variants fused,unfused,lut]
                                 [--scenarios prefill_1x512,decode_1,decode_16,decode_64] [--top 12]
    python bench/profile_step.py --shapes mixtral-shape --variants fused,in_turn_waves --scenarios decode_16
                                 --cache-slots 2
    python bench/profile_step.py --shapes mixtral-shape --expert-dtype int8 --variants fused,in_order_dequant
                                 --scenarios prefill_16x128 --host-profile
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import RUN_DTYPES, SHAPES  # noqa: E402
from bench.kernel_timeline import kernel_totals  # noqa: E402

SCENARIOS = {
    "prefill_1x512": ("prefill", 1, 512),
    "prefill_16x128": ("prefill", 16, 128),
    "prefill_1x2048": ("prefill", 1, 2048),  # a long prompt alone (a shared prefix computed once)
    # 16 prompts' last 64 tokens over 2,048 earlier ones each (the turns after a shared prefix's step)
    "prefill_16x64_after_2048": ("prefill_after", 16, 64),
    "decode_1": ("decode", 1, 128),
    "decode_16": ("decode", 16, 128),
    "decode_64": ("decode", 64, 128),
    "decode_16_at_2048": ("decode", 16, 2048),  # decode over long contexts, where attention weighs
    "decode_1_at_2048": ("decode", 1, 2048),  # one sequence over a long context: the split-K parts matter
}
STEP_TOKENS = 2048  # the engine's max_batch_tokens below
# CudaOptions field -> value of each variant (unlisted fields keep their shipped values). Results recorded before
# the options existed name them by the module switches they replaced (decoder.USE_FUSED_ROPE_KV: fused_rope_kv).
VARIANTS = {
    "fused": {},
    "unfused": {"fused_rope_kv": False, "fused_combine_norm": False, "fused_qk_norm": False},
    "unfused_qk_norm": {"fused_qk_norm": False},
    "lut": {},
    "tiled_attention": {"mma_decode_attention": False},
    "untiled_attention": {"tiled_decode_attention": False, "mma_decode_attention": False},
    "baseline": {
        "fused_rope_kv": False,
        "fused_combine_norm": False,
        "fused_qk_norm": False,
        "fused_router": False,
        "greedy_split": False,
        "tiled_decode_attention": False,
        "mma_decode_attention": False,
    },
    "in_turn_waves": {"pipelined_waves": False},
    "moe_ffn_waves": {"cached_mma": False},
    "in_order_dequant": {"overlap_dequant": False},
    "mma_sync_experts": {"wgmma_experts": False},
    "decode_splits_per_step": {"decode_splits_per_step": True},
    # and parts of one 32-key tile: a lone sequence over 128 tokens in 4 parts a head group instead of 2
    "tile_parts": {"decode_splits_per_step": True, "decode_part_keys": 32},
    "meta_read": {"q8_layout_at_launch": False},  # 8-bit weight streams read their block layout on the device
    "programmatic": {"programmatic_launch": 1},  # every kernel of the chain waits first
    "weights_first": {"programmatic_launch": 2},  # the dense GEMVs load their first weights, then wait
    "l2_prefetch": {"l2_prefetch": True},
    # mixtral-like layers: steps from 96 rows an expert up to 2,048 tokens on the wgmma grouped kernel (the shipped
    # window, `fused`, stops at 1,024), or none (every step above 64 tokens on per-expert cuBLAS)
    "few_expert_off": {"grouped_mma_max_tokens_few_experts": 0},
    "few_expert_mma": {"grouped_mma_max_tokens_few_experts": STEP_TOKENS},
}
# the engine's own options when a variant opens the few-expert window: a window below the largest step reaches both
# GROUPED_MMA and per-expert cuBLAS, so the workspace holds both and set_options may switch between every variant
FEW_EXPERT_LAYOUT = {"grouped_mma_max_tokens_few_experts": 512}
PROFILED_STEPS = {"prefill": 3, "prefill_after": 3, "decode": 10}
CONTEXT_BEFORE = 2048  # prefill_after: tokens each sequence holds before the profiled chunks
POOL_ELEMENTS = 1 << 26  # random bf16 values the weights are cut from (128 MB: a mixtral expert matrix is a view)


def variant_options(variant: str):
    """The CudaOptions a variant runs with."""
    from expert_service.engine.cuda_options import CudaOptions

    return CudaOptions(**VARIANTS[variant])


def write_random_model(family: str, params: dict, out: Path, seed: int = 0) -> Path:
    """A Colibri model directory of `family` with bench/engine.py's shape `params` and random bf16 weights:
    norms 1, routers fresh N(0, 0.02) (uniform routing), everything else slices of one N(0, 0.02) pool."""
    from common.dtypes import float32_to_bf16
    from common.model_writer import ModelWriter
    from common.models import tensor_specs
    from expert_service.tools.tiny_model import tiny_hf_config

    rng = np.random.default_rng(seed)
    hf = {**tiny_hf_config(family), **params, "rope_theta": 1e6, "dtype": "bfloat16"}
    writer = ModelWriter(out, hf, "bfloat16")
    pool = float32_to_bf16(rng.standard_normal(POOL_ELEMENTS, dtype=np.float32) * np.float32(0.02))
    for spec in tensor_specs(writer.config):
        size = int(np.prod(spec.shape))
        leaf = spec.name.rsplit(".", 1)[-1]
        if leaf.endswith("norm"):
            values = np.full(size, 0x3F80, np.uint16)  # bf16 1.0
        elif leaf == "router":
            values = float32_to_bf16(rng.standard_normal(size, dtype=np.float32) * np.float32(0.02))
        elif size <= pool.size:  # a view: no copy, no generator
            start = int(rng.integers(0, pool.size - size + 1))
            values = pool[start : start + size]
        else:  # the pool tiled (slice copies: memcpy speed)
            values = np.empty(size, np.uint16)
            for at in range(0, size, pool.size):
                values[at : at + pool.size] = pool[: size - at]
        writer.write(spec.name, values.reshape(spec.shape))
    return writer.finish()


def random_plan(layers, num_tokens: int, num_experts: int, top_k: int, rng):
    """A routing plan sending each token to top_k distinct uniform random experts at every MoE layer."""
    from common.routing_plan import RoutingPlan

    keys = rng.random((len(layers), num_tokens, num_experts))
    ids = np.argpartition(keys, top_k - 1, axis=2)[:, :, :top_k].astype(np.uint16)
    return RoutingPlan.from_expert_ids(layers, ids, num_experts)


def host_profile(fn, repeats: int, top: int, sync) -> dict:
    """cProfile over `repeats` calls of fn, each followed by sync(): Python calls a step and the top functions by
    own time (us a step)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        fn()
        sync()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    cumulative = sorted(stats.items(), key=lambda kv: -kv[1][3])[:top]

    def name(key) -> str:
        f, line, fn = key
        return f"{Path(f).name}:{line}({fn})"

    return {
        "calls_per_step": sum(v[1] for v in stats.values()) / repeats,
        "top_own_time": {name(k): v[2] / repeats * 1e6 for k, v in ranked},
        "top_cumulative": {name(k): v[3] / repeats * 1e6 for k, v in cumulative},
        # where the three costliest functions are called from: caller -> (calls, own us) a step
        "callers": {
            name(k): {name(c): (cv[1] / repeats, cv[2] / repeats * 1e6) for c, cv in v[4].items()}
            for k, v in ranked[:3]
        },
    }


def summarise(totals: dict, wall_us: float) -> dict:
    busy = sum(t for t, _ in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {
        "wall_us": wall_us,
        "device_busy_us": busy,
        "kernels": {k: {"us": t, "launches": c} for k, (t, c) in ranked},
    }


def compare(a: dict, b: dict) -> dict:
    """Scenario results a vs b: busy and wall differences (a - b) and every kernel whose time or launch count
    differs, largest change first."""
    names = set(a["kernels"]) | set(b["kernels"])
    zero = {"us": 0.0, "launches": 0.0}
    rows = []
    for name in names:
        x, y = a["kernels"].get(name, zero), b["kernels"].get(name, zero)
        if abs(x["launches"] - y["launches"]) > 1e-9 or abs(x["us"] - y["us"]) > 0.5:
            rows.append((name, x["us"] - y["us"], x["launches"] - y["launches"]))
    rows.sort(key=lambda r: -abs(r[1]))
    return {
        "device_busy_us": a["device_busy_us"] - b["device_busy_us"],
        "wall_us": a["wall_us"] - b["wall_us"],
        "kernels": {n: {"us": d, "launches": c} for n, d, c in rows},
    }


class Scenarios:
    """Runs one shape's scenarios on an engine; decode sequences are prefilled once per batch size and shared
    by the variants that use this engine (their contexts grow by the steps each variant runs)."""

    def __init__(
        self,
        engine,
        vocab: int,
        lut: bool,
        seed: int = 0,
        host_top: int = 0,
        planned: bool = False,
        timeline: bool = False,
    ):
        """lut: a routing=lut engine; planned: steps carry a routing plan anyway (the cache's plan prefetch);
        timeline: also mark where each scenario's host time goes (bench/host_timeline.py)."""
        self.engine, self.vocab, self.planned, self.host_top = engine, vocab, lut or planned, host_top
        self.timeline = timeline
        self.rng = np.random.default_rng(seed)
        mc = engine.model_config
        self.layers, self.E, self.K = mc.moe_layers, mc.num_experts, mc.num_experts_per_tok
        self.decoding: dict[int, list[int]] = {}

    def _plans(self, num_tokens: int, distinct: int = 16):
        """Endless routing plans for steps of num_tokens (None without planning): `distinct` random ones in turn, so
        the plan prefetch keeps copying (one plan repeated would find its experts resident after its first step)."""
        if not self.planned:
            return itertools.repeat(None)
        return itertools.cycle(
            [random_plan(self.layers, num_tokens, self.E, self.K, self.rng) for _ in range(distinct)]
        )

    def _sequences(self, b: int, n: int) -> list[int]:
        from expert_service.engine.engine import PrefillInput
        from expert_service.engine.sampling import SamplingParams

        if b not in self.decoding:
            for other in list(self.decoding):  # one batch in the KV pool at a time
                self.engine.release(self.decoding.pop(other))
            ids = list(range(10_000 * b, 10_000 * b + b))
            per_step = max(1, min(16, STEP_TOKENS // n))  # prompts per prefill step, within the step budget
            for start in range(0, b, per_step):
                chunk = [
                    PrefillInput(i, self.rng.integers(0, self.vocab, n), SamplingParams(), True)
                    for i in ids[start : start + per_step]
                ]
                self.engine.step(chunk, routing_plan=next(self._plans(len(chunk) * n, 1)))
            self.decoding[b] = ids
        return self.decoding[b]

    def run(self, scenario: str) -> dict:
        from expert_service.engine.engine import PrefillInput
        from expert_service.engine.sampling import SamplingParams

        kind, b, n = SCENARIOS[scenario]
        engine = self.engine
        if kind == "prefill":
            chunks = [
                PrefillInput(1000 + i, self.rng.integers(0, self.vocab, n), SamplingParams(), True) for i in range(b)
            ]
            plans = self._plans(b * n)

            def fn():
                engine.step(chunks, routing_plan=next(plans))
                engine.release([c.request_id for c in chunks])

            fn()  # eager; profile's own first call captures the bucket's graph, the profiled ones replay
        elif kind == "prefill_after":
            ids = list(range(2000, 2000 + b))
            for i in ids:  # each sequence's earlier tokens, one step apiece
                head = PrefillInput(i, self.rng.integers(0, self.vocab, CONTEXT_BEFORE), SamplingParams(), False)
                engine.step([head], routing_plan=next(self._plans(CONTEXT_BEFORE, 1)))
            plans = self._plans(b * n)

            def fn():  # every call adds n more prompt tokens a sequence (not the last chunk: nothing sampled)
                chunks = [PrefillInput(i, self.rng.integers(0, self.vocab, n), None, False) for i in ids]
                engine.step(chunks, routing_plan=next(plans))

            fn()
        else:
            ids = self._sequences(b, n)
            plans = self._plans(b)
            engine.decoder.drop_graphs()  # this variant's own graphs: eager, capture, replay
            for _ in range(2):
                engine.step(decode_ids=ids, routing_plan=next(plans))

            def fn():
                engine.step(decode_ids=ids, routing_plan=next(plans))

        totals, wall_us = kernel_totals(fn, PROFILED_STEPS[kind])
        entry = summarise(totals, wall_us)
        if self.host_top:
            import torch

            entry["host"] = host_profile(fn, PROFILED_STEPS[kind], self.host_top, torch.cuda.synchronize)
        if self.timeline:
            import torch

            from bench.host_timeline import host_timeline

            entry["host_timeline"] = host_timeline(fn, torch.cuda.synchronize)
        if kind == "prefill_after":
            engine.release(ids)
        return entry


def run_shape(name: str, workdir: Path, variants: list[str], scenarios: list[str], top: int, on_result, args) -> dict:
    from bench.engine import random_model
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.engine.cuda_options import CudaOptions

    family, params = SHAPES[name]
    started = time.perf_counter()
    if args.expert_dtype == "bfloat16":
        model_dir = write_random_model(family, params, workdir / name)
    else:
        model_dir = random_model(family, params, workdir / name, args.expert_dtype)
    print(f"{name}: model written in {time.perf_counter() - started:.1f} s", flush=True)
    results: dict[str, dict] = {}
    try:
        for lut in (False, True):
            group = [v for v in variants if (v == "lut") == lut]
            if not group:
                continue
            few = any("grouped_mma_max_tokens_few_experts" in VARIANTS[v] for v in group)
            layout = FEW_EXPERT_LAYOUT if few else {}
            engine = build_engine(
                ModelDir.open(model_dir, verify=False),
                EngineConfig(
                    backend="cuda",
                    kv_block_size=16,
                    kv_cache_tokens=96 * 512,  # prefill_16x64_after_2048 holds 16 x ~2,400 tokens
                    max_batch_tokens=STEP_TOKENS,
                    max_batch_size=64,
                    routing="lut" if lut else "exact",
                    expert_cache_slots=args.cache_slots,
                    prefetch=args.prefetch if args.cache_slots else "none",
                    cuda_options=CudaOptions(**layout),
                ),
            )
            planned = bool(args.cache_slots) and "plan" in args.prefetch
            runner = Scenarios(
                engine,
                params["vocab_size"],
                lut,
                host_top=top if args.host_profile else 0,
                planned=planned,
                timeline=args.host_timeline,
            )
            try:
                for scenario in scenarios:  # variants inner: same sequences, adjacent in time
                    for variant in group:
                        engine.decoder.set_options(variant_options(variant))
                        entry = runner.run(scenario)
                        results.setdefault(variant, {})[scenario] = entry
                        _print(name, variant, scenario, entry, top)
                        on_result(results)
            finally:
                engine.decoder.close()
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    if "fused" in results and "unfused" in results:
        results["fused_minus_unfused"] = {
            s: compare(results["fused"][s], results["unfused"][s])
            for s in scenarios
            if s in results["fused"] and s in results["unfused"]
        }
        for s, diff in results["fused_minus_unfused"].items():
            changed = ", ".join(
                f"{k} {v['us']:+.1f} us ({v['launches']:+.0f})" for k, v in list(diff["kernels"].items())[:6]
            )
            print(
                f"{name} {s} fused - unfused: busy {diff['device_busy_us']:+.1f} us, wall {diff['wall_us']:+.1f} us; "
                f"{changed}",
                flush=True,
            )
    return results


def _print(shape: str, variant: str, scenario: str, entry: dict, top: int) -> None:
    wall, busy = entry["wall_us"], entry["device_busy_us"]
    print(f"\n{shape} {variant} {scenario}: wall {wall:.0f} us, device busy {busy:.0f} us ({busy / wall:.0%})")
    for k, v in list(entry["kernels"].items())[:top]:
        print(f"  {v['us']:9.1f} us  {v['launches']:6.1f}x  {k}")
    if "host" in entry:
        print(f"  host: {entry['host']['calls_per_step']:.0f} Python calls a step; own time a step:")
        for k, us in entry["host"]["top_own_time"].items():
            print(f"  {us:9.1f} us  {k}")
        print("  host: cumulative time a step:")
        for k, us in entry["host"]["top_cumulative"].items():
            print(f"  {us:9.1f} us  {k}")
        for k, callers in entry["host"]["callers"].items():
            print(
                f"  called into {k} from: " + "; ".join(f"{c} {n:.0f}x {us:.0f} us" for c, (n, us) in callers.items())
            )
    if "host_timeline" in entry:
        print("  host timeline of one step (us from its start):")
        for label, us in entry["host_timeline"]:
            print(f"  {us:9.0f} us  {label}")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--variants", default="fused,unfused", help=f"comma-separated of {', '.join(VARIANTS)}")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated of {', '.join(SCENARIOS)}")
    parser.add_argument("--workdir", default="/dev/shm/colibri-profile")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument(
        "--expert-dtype",
        default="bfloat16",
        choices=RUN_DTYPES,
        help="the experts' storage (+head: the LM head too, +attn: the attention projections)",
    )
    parser.add_argument("--cache-slots", type=int, default=0, help="expert cache slots per MoE layer (0: resident)")
    parser.add_argument("--prefetch", default="none", help="the expert cache's prefetch (with --cache-slots)")
    parser.add_argument("--host-profile", action="store_true", help="also cProfile the host side of each scenario")
    parser.add_argument(
        "--host-timeline", action="store_true", help="also mark where one step's host time goes (host_timeline.py)"
    )
    args = parser.parse_args()
    if args.cache_slots < 0:
        parser.error(f"--cache-slots: must be >= 0, got {args.cache_slots}")
    variants, scenarios = args.variants.split(","), args.scenarios.split(",")
    for value, known, what in ((variants, VARIANTS, "variant"), (scenarios, SCENARIOS, "scenario")):
        unknown = [v for v in value if v not in known]
        if unknown:
            parser.error(f"--{what}s: unknown {what} {unknown[0]!r} (known: {', '.join(known)})")
    import torch

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "device": torch.cuda.get_device_name(),
        "variants": {v: VARIANTS[v] for v in variants},
        "profiled_steps": PROFILED_STEPS,
        "expert_dtype": args.expert_dtype,
        "cache_slots": args.cache_slots,
        "shapes": {},
    }

    def save(shape_results, name=None):
        if name is not None:
            results["shapes"][name] = shape_results
        (out_dir / "profile_step.json").write_text(json.dumps(results, indent=1))

    for name in args.shapes.split(","):
        results["shapes"][name] = {}
        shape = run_shape(
            name,
            Path(args.workdir),
            variants,
            scenarios,
            args.top,
            lambda partial, name=name: save(partial, name),
            args,
        )
        save(shape, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
