"""Small memory-bound kernels of a step under their current launch shape against the previous one, in one run
(GPU; qwen3moe shape: D 2048, H 32, Hkv 4, Hd 128, top-8).

- rmsnorm over per-head rows [T*H, 128] (the q/k norms): a warp per row, 8 rows a block (the default) vs one
  block of 128 threads per row with a block reduction (`threads=128`, the previous default);
- rope_kv_write [T tokens] and moe_combine [T tokens x 8 experts x 2048]: rows spread over blocks
  (`numeric.blocks_per_row`) vs one block per token (SPREAD_TARGET_BLOCKS = 1);
- qk_norm_rope_kv_write [T tokens]: the per-head q/k norms, RoPE and the KV write in one launch vs rmsnorm on q,
  rmsnorm on k, then rope_kv_write (bf16 norm weights and pools);
- qkv_gemv (T = 1 only): one GEMV over the stacked q|k|v rows [5120 x 2048] bf16 vs three GEMVs (q, k, v), over
  QKV_COPIES copies of the weights in turn so each launch reads cold weights from HBM, as a step does;
- prefill sizes only (T >= 512): moe_gather_bf16 [T*8 rows x 2048] (words of 4 bf16 vs the one-element kernel,
  which odd widths still take) and the bf16 cast of [T, 6144] (words of 4, uncapped grid vs one element a
  thread over at most elementwise.MAX_BLOCKS blocks: `cast_reference_launch` below).
Both shapes of each kernel give the same bits (tested in tests/expert_service/kernels; the qkv GEMV within
float32 rounding, tested in tests/expert_service/cuda/test_fusions.py); only time differs.
GPU time per launch: `--repeats` launches captured in one CUDA graph and replayed between two events
(bench/kernels.py `graph_timed`). One line per case with both times and the ratio previous / current (> 1:
current faster); JSON to --out.

    python bench/small_kernels.py --out out/small_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernels import graph_timed  # noqa: E402
from common.dtypes import float32_to_bf16  # noqa: E402
from expert_service.kernels.numeric import f32_to_bf16  # noqa: E402

D, H, HKV, HD, K = 2048, 32, 4, 128, 8
TOKENS = (1, 16, 64, 512, 2048)
PREFILL_TOKENS = 512  # the gather and the cast run at this many tokens and more
CAST_COLS, GATHER_BLOCK_M = 6144, 64
QKV_COPIES = 8  # 8 x 21 MB of q|k|v weights: more than the H200's 50 MB L2


@cuda.jit
def _cast_reference_kernel(x, out):
    """The previous cast: x [n] float32 -> out [n] uint16 (bf16 bits), one element a thread per grid-stride step."""
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        out[i] = f32_to_bf16(x[i])


def cast_reference_launch(x, out, stream) -> None:
    """The previous launch_cast to bfloat16: 256 threads, grid capped at elementwise.MAX_BLOCKS."""
    from expert_service.kernels.elementwise import MAX_BLOCKS

    blocks = min(MAX_BLOCKS, -(-x.size // 256))
    _cast_reference_kernel[blocks, 256, stream](x.reshape(-1), out.reshape(-1))


def qkv_gemv_case(rng, dev, state):
    """A one-token step's q, k, v projections (qwen3 shape, bf16): launch(i, stream) over weight copy i."""
    from expert_service.kernels.gemv import launch_gemv

    sizes = (H * HD, HKV * HD, HKV * HD)
    stacked = [
        dev(float32_to_bf16(rng.standard_normal((sum(sizes), D), dtype=np.float32) * 0.02)) for _ in range(QKV_COPIES)
    ]
    parts = [(w[: sizes[0]], w[sizes[0] : sizes[0] + sizes[1]], w[sizes[0] + sizes[1] :]) for w in stacked]
    x = dev(rng.standard_normal((1, D), dtype=np.float32))
    out = cuda.device_array((1, sum(sizes)), np.float32)
    views = [cuda.device_array((1, n), np.float32) for n in sizes]

    def launch(i, st):
        if state["previous"]:
            for weight, y in zip(parts[i % QKV_COPIES], views):
                launch_gemv(x, weight, y, stream=st)
        else:
            launch_gemv(x, stacked[i % QKV_COPIES], out, stream=st)

    return launch


def cases(T: int, rng) -> dict:
    """name -> (launch(i, stream), set_previous(bool)) for a step of T tokens."""
    import expert_service.kernels.numeric as numeric
    from expert_service.kernels import moe_align
    from expert_service.kernels.elementwise import launch_cast
    from expert_service.kernels.moe_combine import launch_moe_combine
    from expert_service.kernels.qk_norm_rope_kv_write import launch_qk_norm_rope_kv_write
    from expert_service.kernels.rmsnorm import launch_rmsnorm
    from expert_service.kernels.rope_kv_write import launch_rope_kv_write

    dev = lambda a: cuda.to_device(np.ascontiguousarray(a))  # noqa: E731
    heads = dev(rng.standard_normal((T * H, HD), dtype=np.float32))
    norm_w = dev(rng.standard_normal(HD, dtype=np.float32))
    q = dev(rng.standard_normal((T, H, HD), dtype=np.float32))
    k, v = (dev(rng.standard_normal((T, HKV, HD), dtype=np.float32)) for _ in range(2))
    positions = dev(rng.integers(0, 4096, T).astype(np.int32))
    inv_freq = dev((1.0 / 1e6 ** (np.arange(0, HD, 2) / HD)).astype(np.float32))
    slots = dev(rng.permutation(T * 4)[:T].astype(np.int32))
    k_pool, v_pool = (cuda.device_array((T * 4 // 16 + 1, 16, HKV, HD), np.uint16) for _ in range(2))
    y = dev(rng.standard_normal((T * K, D), dtype=np.float32))
    position = dev(rng.permutation(T * K).astype(np.int32))
    weights = dev(rng.random((T, K), dtype=np.float32))
    h = dev(rng.standard_normal((T, D), dtype=np.float32))
    state = {"previous": False}
    spread_default = numeric.SPREAD_TARGET_BLOCKS  # every case ends with set_previous(False): restored

    def spread(previous: bool) -> None:
        numeric.SPREAD_TARGET_BLOCKS = 1 if previous else spread_default

    def flag(previous: bool) -> None:
        state.update(previous=previous)

    qk_w = [dev(float32_to_bf16(rng.standard_normal(HD, dtype=np.float32))) for _ in range(2)]

    def qk_norm_rope_kv(i, st):
        if state["previous"]:
            launch_rmsnorm(q.reshape(T * H, HD), qk_w[0], 1e-6, q.reshape(T * H, HD), stream=st)
            launch_rmsnorm(k.reshape(T * HKV, HD), qk_w[1], 1e-6, k.reshape(T * HKV, HD), stream=st)
            launch_rope_kv_write(q, k, v, positions, inv_freq, 1.0, slots, k_pool, v_pool, stream=st)
        else:
            launch_qk_norm_rope_kv_write(
                q, k, v, qk_w[0], qk_w[1], 1e-6, positions, inv_freq, 1.0, slots, k_pool, v_pool, stream=st
            )

    out = {
        "rmsnorm_heads": (
            lambda i, st: launch_rmsnorm(
                heads, norm_w, 1e-6, heads, stream=st, threads=128 if state["previous"] else None
            ),
            flag,
        ),
        "qk_norm_rope_kv_write": (qk_norm_rope_kv, flag),
        "rope_kv_write": (
            lambda i, st: launch_rope_kv_write(q, k, v, positions, inv_freq, 1.0, slots, k_pool, v_pool, stream=st),
            spread,
        ),
        "moe_combine": (lambda i, st: launch_moe_combine(y, position, weights, h, stream=st), spread),
    }
    if T == 1:
        out["qkv_gemv"] = (qkv_gemv_case(rng, dev, state), flag)
    if T < PREFILL_TOKENS:
        return out
    rows = T * K  # every row an assignment (no padding rows)
    sorted_ids = dev(rng.permutation(rows).astype(np.int32))
    num_tiles = dev(np.array([rows // GATHER_BLOCK_M], np.int32))
    xs = cuda.device_array((rows, D), np.uint16)
    gather_args = (h, sorted_ids, num_tiles, np.int32(K), np.int32(GATHER_BLOCK_M), xs)
    wide = dev(rng.standard_normal((T, CAST_COLS), dtype=np.float32))
    wide_bf16 = cuda.device_array((T, CAST_COLS), np.uint16)

    def gather(i, st):
        if state["previous"]:
            moe_align._gather_bf16_kernel[rows, moe_align.GATHER_THREADS, st](*gather_args)
        else:
            moe_align.launch_moe_gather_bf16(h, sorted_ids, num_tiles, K, GATHER_BLOCK_M, xs, stream=st)

    def cast(i, st):
        if state["previous"]:
            cast_reference_launch(wide, wide_bf16, st)
        else:
            launch_cast(wide, wide_bf16, stream=st)

    out.update(gather_bf16=(gather, flag), cast_bf16=(cast, flag))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/small_kernels.json")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    results = {"device": cuda.get_current_device().name, "repeats": args.repeats, "cases": []}
    for T in TOKENS:
        for name, (launch, set_previous) in cases(T, rng).items():
            times = {}
            for label, previous in (("previous", True), ("current", False)):
                set_previous(previous)
                times[label] = graph_timed(launch, stream, args.repeats) * 1e6
            set_previous(False)
            row = {
                "kernel": name,
                "tokens": T,
                "previous_us": times["previous"],
                "current_us": times["current"],
                "previous_over_current": times["previous"] / times["current"],
            }
            results["cases"].append(row)
            print(
                f"{name:14s} T={T:5d}  previous {times['previous']:8.2f} us  current {times['current']:8.2f} us  "
                f"x{row['previous_over_current']:.2f}",
                flush=True,
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
