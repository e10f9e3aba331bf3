"""Decode attention kernels -- expert_service.kernels.attention_decode (`new`), attention_decode_tiled
(`tiled`: bf16 key tiles staged by cp.async) and attention_decode_mma (`mma`: tensor cores, GQA heads as the mma
rows; `mma_k32`, `mma_k256`: split parts of at least 32 / 256 keys instead of MIN_PART_KEYS; `mma_3stage`: two tiles in
flight instead of one; `tiled_k32`, `tiled_k128`, `tiled_k256`: the tiled kernel's parts of at least 32 / 128 / 256
keys instead of attention_decode.MIN_PART_KEYS) -- against
PyTorch's scaled_dot_product_attention and, when given, a previous version of the attention_decode module
(--previous FILE), in one run (GPU).

Shapes: the mixtral (H=32, Hkv=8) and qwen3moe (H=32, Hkv=4) attention at head size 128 over a bf16 paged
KV pool (16-token blocks, shuffled block ids), batches 1, 16, 64 at contexts 128 (what bench/engine.py's decode
steps attend over), 1024 and 4096. Split-K counts come from `decode_splits` with a 4096-token model context, as
the decoder's. The reference is what Hugging Face runs: SDPA (enable_gqa) on a contiguous bf16 cache, gathered
beforehand (not timed). Times are GPU time per launch (graph replay); the roofline is the K/V bytes / this GPU's
streaming HBM read rate (bench/hbm_rate.py, measured at the start of the run; --hbm-bytes-per-s to override).
Each case also checks the kernels against each other (float32, same inputs) and against SDPA.

    python bench/attention_decode.py --out out/attention_decode.json [--previous OLD_attention_decode.py]
                                     [--only qwen3moe-shape:64:1024 ...]

`--only` runs the named cases alone, e.g. under Nsight Compute:
    ncu -k regex:attention_decode --launch-count 2 python bench/attention_decode.py --only qwen3moe-shape:64:1024
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import hbm_rate  # noqa: E402
from bench.kernels import graph_timed, load_module, torch_timed  # noqa: E402

SHAPES = {"mixtral-shape": (32, 8), "qwen3moe-shape": (32, 4)}
CASES = [(b, ctx) for b in (1, 16, 64) for ctx in (128, 1024)] + [(1, 4096), (16, 4096)]
HEAD_DIM, BLOCK, MODEL_CONTEXT, REPEATS = 128, 16, 4096, 50


def build_case(rng, b: int, ctx: int, H: int, Hkv: int):
    """Host arrays: q [b, H, Hd] f32, pools [NB, BLOCK, Hkv, Hd] bf16 bits, tables, lens, positions."""
    from tests.helpers import random_cache

    blocks = b * -(-ctx // BLOCK) + 1
    k_pool, v_pool, tables, _ = random_cache(rng, [ctx] * b, blocks, BLOCK, Hkv, HEAD_DIM, np.uint16)
    q = rng.standard_normal((b, H, HEAD_DIM), dtype=np.float32)
    lens = np.full(b, ctx, np.int32)
    return q, k_pool, v_pool, tables, lens, lens - 1


def run_kernel(launcher, splits, dev, b: int, H: int, Hkv: int, stream, model_context: int = MODEL_CONTEXT):
    """(seconds per launch, output, P) of a decode-attention launcher on the device arrays `dev`, with the
    split count splits(b, H, Hkv, model_context)."""
    from numba import cuda

    q, k, v, tables, lens, pos = dev
    P = splits(b, H, Hkv, model_context)
    out = cuda.device_array((b, H, HEAD_DIM), np.float32, stream=stream)
    parts = [cuda.device_array((b, H, P, n), np.float32, stream=stream) for n in (HEAD_DIM, 2)] if P > 1 else [None] * 2

    def launch(i, st):
        launcher(q, k, v, tables, lens, pos, 0, HEAD_DIM**-0.5, out, *parts, stream=st)

    seconds = graph_timed(launch, stream, REPEATS)
    return seconds, out.copy_to_host(), P


def sdpa(host, b: int, H: int, Hkv: int):
    """(seconds per call, output [b, H, Hd] float32) of torch SDPA over the gathered contiguous bf16 cache."""
    import torch

    q, k_pool, v_pool, tables, lens, _ = host
    ctx = int(lens[0])

    def contiguous(pool):
        bits = pool[tables[:, : -(-ctx // BLOCK)]].reshape(b, -1, Hkv, HEAD_DIM)[:, :ctx]
        t = torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)
        return t.transpose(1, 2).contiguous().cuda()

    k, v = contiguous(k_pool), contiguous(v_pool)
    qt = torch.from_numpy(q).cuda().to(torch.bfloat16).unsqueeze(2)
    result = {}

    def call(i):
        result["out"] = torch.nn.functional.scaled_dot_product_attention(qt, k, v, enable_gqa=True)

    seconds = torch_timed(call, REPEATS, graph=True)
    return seconds, result["out"].squeeze(2).float().cpu().numpy()


def _case(text: str) -> tuple:
    """--only's SHAPE:B:CTX -> (shape, batch, context), one of the cases this bench runs."""
    parts = text.split(":")
    known = [f"{shape}:{b}:{ctx}" for shape in SHAPES for b, ctx in CASES]
    if text not in known:
        raise argparse.ArgumentTypeError(f"no such case {text!r}; one of {', '.join(known)}")
    return parts[0], int(parts[1]), int(parts[2])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="attention_decode.json")
    parser.add_argument("--previous", help="an earlier attention_decode.py to time in the same run")
    parser.add_argument(
        "--model-context", type=int, default=MODEL_CONTEXT, help="the longest context decode_splits plans P for"
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        type=_case,
        metavar="SHAPE:B:CTX",
        help="run only these cases (repeatable)",
    )
    hbm_rate.add_argument(parser)
    args = parser.parse_args(argv)
    only = set(args.only)
    from numba import cuda

    from expert_service.kernels import attention_decode, attention_decode_mma, attention_decode_tiled

    kernels = {
        "new": (attention_decode.launch_attention_decode, attention_decode.decode_splits),
        "tiled": (attention_decode_tiled.launch_attention_decode_tiled, attention_decode.decode_splits),
    }
    kernels["mma"] = (attention_decode_mma.launch_attention_decode_mma, attention_decode.decode_splits)
    for keys in (32, 256):
        launch = functools.partial(attention_decode_mma.launch_attention_decode_mma, min_keys=keys)
        kernels[f"mma_k{keys}"] = (launch, attention_decode.decode_splits)
    for keys in (32, 128, 256):
        launch = functools.partial(attention_decode_tiled.launch_attention_decode_tiled, min_keys=keys)
        kernels[f"tiled_k{keys}"] = (launch, attention_decode.decode_splits)
    launch = functools.partial(attention_decode_mma.launch_attention_decode_mma, stages=3)
    kernels["mma_3stage"] = (launch, attention_decode.decode_splits)
    if args.previous:
        previous = load_module(args.previous)
        kernels["previous"] = (previous.launch_attention_decode, previous.decode_splits)
    roofline = hbm_rate.roofline(args.hbm_bytes_per_s)
    print(roofline.summary(), flush=True)
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    results = []
    for shape, (H, Hkv) in SHAPES.items():
        for b, ctx in CASES:
            if only and (shape, b, ctx) not in only:
                continue
            host = build_case(rng, b, ctx, H, Hkv)
            dev = [cuda.to_device(a, stream=stream) for a in host]
            row = {"shape": shape, "batch": b, "context": ctx, "kv_bytes": 2 * b * ctx * Hkv * HEAD_DIM * 2}
            outs = {}
            for name, (launcher, splits) in kernels.items():
                seconds, outs[name], P = run_kernel(launcher, splits, dev, b, H, Hkv, stream, args.model_context)
                row[f"{name}_us"], row[f"{name}_splits"] = seconds * 1e6, P
            ref_s, ref = sdpa(host, b, H, Hkv)
            row["sdpa_us"] = ref_s * 1e6
            row["roofline_us"] = row["kv_bytes"] / roofline.bytes_per_s * 1e6
            row["new_vs_sdpa_max_rel"] = float(np.abs(outs["new"] - ref).max() / np.abs(ref).max())
            row["tiled_vs_new_max_abs"] = float(np.abs(outs["tiled"] - outs["new"]).max())
            row["tiled_speedup_vs_new"] = row["new_us"] / row["tiled_us"]
            variants = [k for k in outs if k.startswith("tiled_k")]
            row["tiled_k_vs_tiled_max_abs"] = max(float(np.abs(outs[k] - outs["tiled"]).max()) for k in variants)
            row["mma_vs_sdpa_max_rel"] = float(np.abs(outs["mma"] - ref).max() / np.abs(ref).max())
            row["mma_speedup_vs_tiled"] = row["tiled_us"] / row["mma_us"]
            row["mma_speedup_vs_sdpa"] = row["sdpa_us"] / row["mma_us"]
            row["mma_roofline_fraction"] = row["roofline_us"] / row["mma_us"]
            if "previous" in outs:
                row["new_vs_previous_max_abs"] = float(np.abs(outs["new"] - outs["previous"]).max())
                row["speedup_vs_previous"] = row["previous_us"] / row["new_us"]
            row["speedup_vs_sdpa"] = row["sdpa_us"] / row["new_us"]
            row["roofline_fraction"] = row["roofline_us"] / row["new_us"]
            results.append(row)
            by_min_keys = " ".join(f"{k} {row[k + '_us']:.1f}" for k in variants)
            prev = ""
            if "previous" in outs:
                prev = f"previous {row['previous_us']:7.1f} us ({row['speedup_vs_previous']:.2f}x)  "
            print(
                f"{shape:15s} b={b:3d} ctx={ctx:5d} P={row['new_splits']:3d}  new {row['new_us']:7.1f} us  "
                f"tiled {row['tiled_us']:7.1f} us ({row['tiled_speedup_vs_new']:.2f}x)  "
                f"{by_min_keys}  {prev}"
                f"sdpa {row['sdpa_us']:7.1f} us ({row['speedup_vs_sdpa']:.2f}x)  "
                f"roofline {row['roofline_fraction']:.0%}  diff vs sdpa {row['new_vs_sdpa_max_rel']:.1e}\n"
                f"{'':15s} mma {row['mma_us']:7.1f} us ({row['mma_speedup_vs_tiled']:.2f}x tiled, "
                f"{row['mma_speedup_vs_sdpa']:.2f}x sdpa, roofline {row['mma_roofline_fraction']:.0%}, diff vs sdpa "
                f"{row['mma_vs_sdpa_max_rel']:.1e})  k32 {row['mma_k32_us']:7.1f} us  k256 {row['mma_k256_us']:7.1f} us  3 stages {row['mma_3stage_us']:7.1f} us",
                flush=True,
            )
            Path(args.out).write_text(json.dumps({**roofline.record(), "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
