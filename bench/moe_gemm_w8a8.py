"""The W8A8 grouped MoE GEMM (kernels/moe_gemm_w8a8.py: 8-bit weights x 8-bit activation rows on Hopper's 8-bit
tensor cores) against, in the same run on the same 8-bit experts: the widening 8-bit wgmma kernel
(kernels/moe_gemm_q8wgmma.py, bf16 activations), and two dense cuBLAS GEMMs of the routed rows' FLOPs through torch --
bf16 (what the per-expert cuBLAS path reaches at best) and fp8 e4m3 with per-row / per-column scales
(torch._scaled_mm: what 8-bit tensor cores reach at that size). GPU only (sm_90).

Per (shape, T, kind): uniform random top-k routing, random 8-bit expert blocks in the model-file layout (int8 per
channel, fp8 per channel, fp8 in 128x128 blocks: random codes and scales, no quantization pass), moe_align once per
tile; then, timed by CUDA-graph replay (device time only):
  w8a8:     quantize_rows(x) + gate|up + quantize_rows(h) + down   (what a W8A8 step runs)
  w8a8_other_tile (per-channel kinds): the same on the other tile (64 rows an M tile where the engine takes 128,
            from WGMMA_MIN_ROWS rows an expert, and 128 below it)
  q8wgmma:  bf16 gather + gate|up + down on the widening wgmma kernel (128-row tile)
  q8mma:    the same on the widening mma.sync kernel at its own tile (what Q8_MMA runs below 96 rows an expert)
TFLOP/s counts the routed rows' FLOPs only. Accuracy: each variant's y against float64 numpy on up to 64 routed
rows of two experts (W8A8 against its own arithmetic, moe_reference_w8a8 on its quantized rows; q8wgmma against the
bf16-activation expert), max |diff| / max |ref|.

    python bench/moe_gemm_w8a8.py --out bench/results/h200-moe-gemm-w8a8.json [--shapes mixtral,qwen3moe]
                                  [--tokens 512,2048] [--kinds int8,fp8,fp8_block]
Prints per case: us and TFLOP/s of each, and the ratios of w8a8 to the other tile, q8wgmma, q8mma, cuBLAS bf16 and
cuBLAS fp8 (> 1: w8a8 is faster).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernels import graph_timed, torch_timed  # noqa: E402
from bench.moe_gemm import SHAPES  # noqa: E402

KINDS = {"int8": (2, 1), "fp8": (3, 1), "fp8_block": (3, 2)}  # name -> (expert_quant code, scheme)
SAMPLE_ROWS = 64  # routed rows checked against numpy (of two experts)


def random_layer(rng, E: int, F: int, D: int, code: int, scheme: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [E, stride] blocks of random codes (finite e4m3 only: 0x7f / 0xff are NaN) and scales of the size
    quantization gives (values ~ N(0, 1 / fan_in)), with meta [E, META_WIDTH]."""
    from expert_service.kernels import expert_quant as q

    offs = q.block_offsets(code, scheme, F, D)
    stride = -(-offs[6] // 4096) * 4096
    blocks = np.zeros((E, stride), np.uint8)
    limit = 127.0 if code == q.CODE_INT8 else 448.0
    for e in range(E):
        for k, (rows, cols) in enumerate(((F, D), (F, D), (D, F))):
            raw = rng.integers(0, 256, rows * cols, dtype=np.uint8)
            if code == q.CODE_INT8:
                raw[raw == 0x80] = 0  # -128 is outside the symmetric range
            else:
                raw[(raw & 0x7F) == 0x7F] = 0x7E
            blocks[e, offs[k] : offs[k] + raw.size] = raw
            shape = q.scale_shape(scheme, rows, cols)
            scales = np.full(shape, 3.0 / np.sqrt(cols) / limit, np.float32) * rng.uniform(0.5, 1.5, shape)
            flat = scales.astype(np.float32).reshape(-1).view(np.uint8)
            blocks[e, offs[3 + k] : offs[3 + k] + flat.size] = flat
    meta = np.stack([q.meta_row(code, scheme, offs)] * E)
    return blocks, meta


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="moe_gemm_w8a8.json")
    ap.add_argument("--shapes", default="mixtral,qwen3moe")
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    import torch
    from numba import cuda

    from expert_service.cuda.driver import non_blocking_stream
    from expert_service.cuda.moe_grouped_mma import WGMMA_MIN_ROWS, W8A8Kind, gemms_on_bf16_rows, w8a8_experts
    from expert_service.kernels import expert_quant as q
    from expert_service.kernels.moe_align import launch_moe_align, launch_moe_gather_bf16, max_tiles
    from expert_service.kernels.moe_gemm_mma import bf16_round
    from expert_service.kernels.moe_gemm_q8mma import choose_config as choose_q8_config
    from expert_service.kernels.moe_gemm_w8a8 import (
        config_for,
        moe_reference_w8a8,
    )
    from expert_service.kernels.moe_gemm_wgmma import CONFIGS

    _, stream = non_blocking_stream()
    rng = np.random.default_rng(0)
    results: dict = {"device": torch.cuda.get_device_name(), "cases": []}

    def graph_us(launch):
        return graph_timed(lambda i, s: launch(s), stream, args.reps) * 1e6

    for shape in args.shapes.split(","):
        D, F, E, K = (SHAPES[shape][k] for k in "DFEK")
        for kind in args.kinds.split(","):
            code, scheme = KINDS[kind]
            blocks, meta = random_layer(rng, E, F, D, code, scheme)
            dW, dmeta = cuda.to_device(blocks), cuda.to_device(meta)
            for T in map(int, args.tokens.split(",")):
                n = T * K
                ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
                x = rng.standard_normal((T, D)).astype(np.float32)
                dids, dx = cuda.to_device(ids), cuda.to_device(x)
                flops = 2.0 * n * D * 2 * F + 2.0 * n * F * D
                case: dict = {"shape": shape, "kind": kind, "T": T, "assignments": n, "variants": {}}
                blocked = scheme == q.SCALE_BLOCK
                # the tile the engine gives this step (wide from WGMMA_MIN_ROWS rows an expert), and the other one
                wide = n >= WGMMA_MIN_ROWS * min(E, n)
                tiles_of = [("w8a8", config_for(blocked, wide))]
                if not blocked:
                    tiles_of.append(("w8a8_other_tile", config_for(blocked, not wide)))
                tiles_of += [("q8wgmma", CONFIGS["w128"]), ("q8mma", choose_q8_config(n, E))]
                for name, cfg in tiles_of:
                    bm = cfg.block_m
                    tiles = max_tiles(n, E, bm)
                    rows = tiles * bm
                    sorted_ids, tile_expert = cuda.device_array(rows, np.int32), cuda.device_array(tiles, np.int32)
                    num_tiles, position = cuda.device_array(1, np.int32), cuda.device_array(n, np.int32)
                    launch_moe_align(dids, E, bm, sorted_ids, tile_expert, num_tiles, position, stream=stream)
                    h = cuda.device_array((rows, F), np.uint16)
                    y = cuda.device_array((n, D), np.float32)
                    if name.startswith("w8a8"):
                        xq, hq = cuda.device_array((rows, D), np.uint8), cuda.device_array((rows, F), np.uint8)
                        xs, hs = cuda.device_array(rows, np.float32), cuda.device_array(rows, np.float32)

                        def step(s):
                            w8a8_experts(
                                dx,
                                sorted_ids,
                                tile_expert,
                                num_tiles,
                                K,
                                dW,
                                dmeta,
                                W8A8Kind(code, blocked),
                                F,
                                D,
                                xq,
                                xs,
                                hq,
                                hs,
                                h,
                                y,
                                cfg,
                                s,
                            )
                    else:  # the widening kernel of cfg's kind (wgmma or mma.sync), as Q8_MMA runs it
                        xb = cuda.device_array((rows, D), np.uint16)

                        def step(s):
                            launch_moe_gather_bf16(dx, sorted_ids, num_tiles, K, bm, xb, stream=s)
                            gemms_on_bf16_rows(cfg, xb, h, y, sorted_ids, tile_expert, num_tiles, dW, dmeta, F, D, s)

                    us = graph_us(step)
                    stream.synchronize()
                    # accuracy on a sample of routed rows (row r of the sorted order holds assignment order[r])
                    order = sorted_ids.copy_to_host()[: int(num_tiles.copy_to_host()[0]) * bm]
                    # rows of two experts only: a mixtral expert dequantised in float64 is 1.4 GB and a second
                    routed = np.flatnonzero(order >= 0)
                    of = ids.reshape(-1)[order[routed]]
                    pool = routed[np.isin(of, np.unique(of)[:2])]
                    picked = rng.choice(pool, min(SAMPLE_ROWS, pool.size), replace=False)
                    got, ref = y.copy_to_host()[order[picked]], np.zeros((picked.size, D))
                    experts = ids.reshape(-1)[order[picked]]
                    if name.startswith("w8a8"):
                        xq_h, hq_h, xs_h, hs_h = (a.copy_to_host()[picked] for a in (xq, hq, xs, hs))
                    for e in np.unique(experts):  # one dequantised expert at a time (mixtral's: 1.4 GB in float64)
                        sel = experts == e
                        if name.startswith("w8a8"):
                            args_e = (xq_h[sel], xs_h[sel], blocks[e], meta[e], F, D, code, hq_h[sel], hs_h[sel])
                            ref[sel] = moe_reference_w8a8(*args_e)[1]
                            continue
                        gate, up, down = (m.astype(np.float64) for m in q.dequantize(blocks[e], meta[e], F, D))
                        xe = bf16_round(x[order[picked][sel] // K]).astype(np.float64)
                        gs = xe @ gate.T
                        ref[sel] = bf16_round((gs / (1 + np.exp(-gs)) * (xe @ up.T)).astype(np.float32)) @ down.T
                    case["variants"][name] = {
                        "us": us,
                        "tflops": flops / us / 1e6,
                        "rel_err": float(np.abs(got - ref).max() / np.abs(ref).max()),
                        "config": list(cfg),
                    }
                a16 = torch.randn(n, D, device="cuda").to(torch.bfloat16)
                h16 = torch.randn(n, F, device="cuda").to(torch.bfloat16)
                w_gu = torch.randn(2 * F, D, device="cuda").to(torch.bfloat16)
                w_dn = torch.randn(D, F, device="cuda").to(torch.bfloat16)
                bf16_us = torch_timed(lambda i: (a16 @ w_gu.T, h16 @ w_dn.T), args.reps, graph=True) * 1e6
                case["cublas_bf16_us"] = bf16_us
                try:  # cuBLASLt fp8: A row-major, B column-major, per-row / per-column float32 scales
                    f8 = torch.float8_e4m3fn
                    a8, h8 = a16.to(f8), h16.to(f8)
                    wg8, wd8 = w_gu.to(f8), w_dn.to(f8)
                    sa, sh = torch.ones(n, 1, device="cuda"), torch.ones(n, 1, device="cuda")
                    sg, sd = torch.ones(1, 2 * F, device="cuda"), torch.ones(1, D, device="cuda")

                    def fp8_pair(i):
                        torch._scaled_mm(a8, wg8.T, scale_a=sa, scale_b=sg, out_dtype=torch.bfloat16)
                        torch._scaled_mm(h8, wd8.T, scale_a=sh, scale_b=sd, out_dtype=torch.bfloat16)

                    case["cublas_fp8_us"] = torch_timed(fp8_pair, args.reps, graph=True) * 1e6
                except Exception as exc:  # noqa: BLE001 -- reported, the rest of the case stands
                    case["cublas_fp8_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                us = {name: v["us"] for name, v in case["variants"].items()}
                w8 = us["w8a8"]
                case["w8a8_vs_q8wgmma"] = us["q8wgmma"] / w8
                case["w8a8_vs_q8mma"] = us["q8mma"] / w8
                case["w8a8_vs_cublas_bf16"] = bf16_us / w8
                if "cublas_fp8_us" in case:
                    case["w8a8_vs_cublas_fp8"] = case["cublas_fp8_us"] / w8
                if "w8a8_other_tile" in us:
                    case["w8a8_vs_other_tile"] = us["w8a8_other_tile"] / w8
                results["cases"].append(case)
                print(
                    f"\n{shape} {kind} T={T} (n={n}): cuBLAS bf16 {bf16_us:.1f} us ({flops / bf16_us / 1e6:.0f} "
                    f"TFLOP/s), fp8 {case.get('cublas_fp8_us', float('nan')):.1f} us"
                )
                for name, v in case["variants"].items():
                    print(f"  {name:15s} {v['us']:9.1f} us {v['tflops']:6.1f} TFLOP/s  err {v['rel_err']:.1e}")
                print("  ratios:", {k: round(v, 3) for k, v in case.items() if k.startswith("w8a8_vs")})
                Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
