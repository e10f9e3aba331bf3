"""Prefill attention -- expert_service.kernels.attention_prefill_mma (tensor cores, one block per 64-query tile and
query head) -- against PyTorch's scaled_dot_product_attention and, when given, a previous version of the module
(--previous FILE, repeatable; each printed under its file name), in one run (GPU), on the steps a served model runs:
whole prompts (causal over their own tokens) and chunks of new tokens after a cached prefix (the turns step of a
prefix-caching round: 16 sequences of 64 new tokens over a 2,048-token shared system prompt).

Shapes: the mixtral (H=32, Hkv=8) and qwen3moe (H=32, Hkv=4) attention at head size 128 over a bf16 paged KV pool
(16-token blocks, shuffled block ids) that already holds the new tokens' keys, as the decoder's step does. Cases
are BATCH x NEW tokens after PREFIX cached ones. The reference is SDPA (enable_gqa) on the contiguous bf16 cache,
gathered beforehand (not timed), with the chunk's causal mask (query i of a sequence sees keys up to PREFIX + i):
with a mask SDPA cannot take its flash kernel, so its time is an upper bound of what transformers pays there.
Times are GPU time per launch (graph replay). Printed per case: both times, the kernel's TFLOP/s over the score
and value products it must compute (causal), its K/V bytes against the HBM roofline if each kv head's keys were
read once (this GPU's streaming read rate, measured at the start of the run by bench/hbm_rate.py;
--hbm-bytes-per-s to override), and its largest difference from SDPA.

    python bench/attention_prefill.py --out out/attention_prefill.json [--previous OLD_attention_prefill_mma.py]
                                      [--only mixtral-shape:16:64:2048 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import hbm_rate  # noqa: E402
from bench.kernels import graph_timed, load_module, torch_timed  # noqa: E402

SHAPES = {"mixtral-shape": (32, 8), "qwen3moe-shape": (32, 4)}
# (batch, new tokens, cached prefix): whole prompts as bench/engine.py prefills them, the 2,048-token chunk of a
# long prompt, and chunks over a cached prefix (bench/serve.py --workload prefix's turns step, and smaller ones)
CASES = [(1, 512, 0), (16, 128, 0), (1, 2048, 0), (16, 64, 2048), (16, 64, 512), (1, 64, 2048)]
HEAD_DIM, BLOCK, REPEATS = 128, 16, 20


def build_case(rng, b: int, new: int, prefix: int, H: int, Hkv: int, head_dim: int = HEAD_DIM, block: int = BLOCK):
    """Host arrays of one step: q [b*new, H, Hd] f32; pools [NB, block, Hkv, Hd] bf16 bits holding every sequence's
    prefix + new keys; tables [b, max_blocks], seq_starts [b+1], positions [b*new] (prefix + i), context_lens [b]
    (prefix + new) int32 -- the launcher's arguments in its order after q."""
    from tests.helpers import random_cache

    ctx = prefix + new
    blocks = b * -(-ctx // block) + 1
    k_pool, v_pool, tables, _ = random_cache(rng, [ctx] * b, blocks, block, Hkv, head_dim, np.uint16)
    q = rng.standard_normal((b * new, H, head_dim), dtype=np.float32)
    seq_starts = np.arange(b + 1, dtype=np.int32) * new
    positions = np.tile(np.arange(prefix, ctx, dtype=np.int32), b)
    context_lens = np.full(b, ctx, np.int32)
    return q, k_pool, v_pool, seq_starts, positions, tables, context_lens


def contiguous_kv(pool, tables, b: int, ctx: int) -> np.ndarray:
    """[b, Hkv, ctx, Hd] bf16 bits of each sequence's first ctx keys, gathered from the paged pool."""
    block, Hkv, Hd = pool.shape[1:]
    rows = pool[tables[:, : -(-ctx // block)]].reshape(b, -1, Hkv, Hd)[:, :ctx]
    return np.ascontiguousarray(rows.transpose(0, 2, 1, 3))


def chunk_mask(new: int, prefix: int) -> np.ndarray:
    """[new, prefix + new] bool: query i of a chunk sees the cached prefix and its chunk up to itself."""
    return np.arange(prefix + new)[None, :] <= prefix + np.arange(new)[:, None]


def sdpa_inputs(host, b: int, new: int, prefix: int, device: str):
    """(q [b, H, new, Hd], k, v [b, Hkv, ctx, Hd] bf16 tensors, mask [new, ctx] bool) for SDPA on `device`."""
    import torch

    q, k_pool, v_pool, _, _, tables, _ = host
    ctx = prefix + new

    def bf16(bits):
        return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16).to(device)

    qt = torch.from_numpy(q.reshape(b, new, *q.shape[1:]).transpose(0, 2, 1, 3).copy()).to(device, torch.bfloat16)
    k, v = (bf16(contiguous_kv(pool, tables, b, ctx)) for pool in (k_pool, v_pool))
    return qt, k, v, torch.from_numpy(chunk_mask(new, prefix)).to(device)


def sdpa_output(qt, k, v, mask):
    """[T, H, Hd] float32 numpy of SDPA on sdpa_inputs' tensors (GQA by enable_gqa; scale 1/sqrt(Hd))."""
    import torch

    out = torch.nn.functional.scaled_dot_product_attention(qt, k, v, attn_mask=mask, enable_gqa=True)
    b, H, new, Hd = out.shape
    return out.transpose(1, 2).reshape(b * new, H, Hd).float().cpu().numpy()


def sdpa_seconds(inputs) -> tuple[float, bool]:
    """(seconds per SDPA call, whether graph-replayed): GPU time from a captured graph as the kernel's, or eager
    launches (CPU launch cost included) where the masked SDPA refuses capture."""
    import torch

    qt, k, v, mask = inputs

    def call(i):
        torch.nn.functional.scaled_dot_product_attention(qt, k, v, attn_mask=mask, enable_gqa=True)

    try:
        return torch_timed(call, REPEATS, graph=True), True
    except RuntimeError as error:  # a backend that cannot be captured
        print(f"sdpa: no graph capture ({str(error).splitlines()[0]}); timing eager calls", flush=True)
        return torch_timed(call, REPEATS, graph=False), False


def causal_flops(b: int, new: int, prefix: int, H: int, head_dim: int = HEAD_DIM) -> float:
    """Multiply-adds x 2 of S = Q K^T and O = P V over the keys each query sees."""
    keys_seen = b * (new * prefix + new * (new + 1) / 2)
    return 4.0 * keys_seen * H * head_dim


def _case(text: str) -> tuple:
    """--only's SHAPE:B:NEW:PREFIX -> (shape, batch, new, prefix), one of the cases this bench runs."""
    known = [f"{shape}:{b}:{n}:{p}" for shape in SHAPES for b, n, p in CASES]
    if text not in known:
        raise argparse.ArgumentTypeError(f"no such case {text!r}; one of {', '.join(known)}")
    shape, b, n, p = text.split(":")
    return shape, int(b), int(n), int(p)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="attention_prefill.json")
    parser.add_argument(
        "--previous",
        action="append",
        default=[],
        help="an earlier (or variant) attention_prefill_mma.py to time in the same run (repeatable)",
    )
    parser.add_argument(
        "--only", action="append", default=[], type=_case, metavar="SHAPE:B:NEW:PREFIX", help="run only these cases"
    )
    hbm_rate.add_argument(parser)
    args = parser.parse_args(argv)
    only = set(args.only)
    from numba import cuda

    from expert_service.kernels.attention_prefill_mma import launch_attention_prefill_mma

    previous = {Path(path).stem: load_module(path) for path in args.previous}

    roofline = hbm_rate.roofline(args.hbm_bytes_per_s)
    print(roofline.summary(), flush=True)
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    results = []
    for shape, (H, Hkv) in SHAPES.items():
        for b, new, prefix in CASES:
            if only and (shape, b, new, prefix) not in only:
                continue
            host = build_case(rng, b, new, prefix, H, Hkv)
            q, k, v, starts, positions, tables, lens = (cuda.to_device(a, stream=stream) for a in host)
            out = cuda.device_array(host[0].shape, np.float32, stream=stream)

            def launch(i, st):
                launch_attention_prefill_mma(q, k, v, starts, positions, tables, lens, 0, HEAD_DIM**-0.5, out, st)

            mma_s = graph_timed(launch, stream, REPEATS)
            got = out.copy_to_host()
            previous_s, previous_out = {}, {}
            for label, module in previous.items():

                def launch_previous(i, st, module=module):
                    module.launch_attention_prefill_mma(
                        q, k, v, starts, positions, tables, lens, 0, HEAD_DIM**-0.5, out, st
                    )

                previous_s[label] = graph_timed(launch_previous, stream, REPEATS)
                previous_out[label] = out.copy_to_host()
            inputs = sdpa_inputs(host, b, new, prefix, "cuda")
            ref = sdpa_output(*inputs)
            sdpa_s, sdpa_graphed = sdpa_seconds(inputs)
            flops = causal_flops(b, new, prefix, H)
            kv_bytes = 2 * b * (prefix + new) * Hkv * HEAD_DIM * 2
            row = {
                "shape": shape,
                "batch": b,
                "new_tokens": new,
                "prefix": prefix,
                "mma_us": mma_s * 1e6,
                "sdpa_us": sdpa_s * 1e6,
                "mma_tflops": flops / mma_s / 1e12,
                "kv_roofline_us": kv_bytes / roofline.bytes_per_s * 1e6,
                "mma_speedup_vs_sdpa": sdpa_s / mma_s,
                "sdpa_graph_replay": sdpa_graphed,
                "mma_vs_sdpa_max_rel": float(np.abs(got - ref).max() / np.abs(ref).max()),
            }
            prev = ""
            for label, seconds in previous_s.items():
                row[f"{label}_us"] = seconds * 1e6
                row[f"speedup_vs_{label}"] = seconds / mma_s
                row[f"mma_vs_{label}_max_rel"] = float(np.abs(got - previous_out[label]).max() / np.abs(ref).max())
                prev += f"{label} {seconds * 1e6:8.1f} us ({row[f'speedup_vs_{label}']:.2f}x)  "
            results.append(row)
            print(
                f"{shape:15s} b={b:3d} new={new:5d} prefix={prefix:5d}  mma {row['mma_us']:8.1f} us "
                f"({row['mma_tflops']:5.1f} TFLOP/s, K/V roofline {row['kv_roofline_us']:6.1f} us)  "
                f"sdpa {row['sdpa_us']:8.1f} us ({row['mma_speedup_vs_sdpa']:.2f}x)  {prev}"
                f"diff vs sdpa {row['mma_vs_sdpa_max_rel']:.1e}",
                flush=True,
            )
            Path(args.out).write_text(json.dumps({**roofline.record(), "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
