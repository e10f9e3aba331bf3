"""The grouped MoE GEMM (kernels/moe_gemm_mma.py) per tile config, against a same-run reference: a dense cuBLAS
GEMM of the same FLOPs (torch bf16 matmul, M = routed rows, one weight matrix) — what tensor cores reach at that
size — and, when given, a previous version of the kernel module (--previous FILE, e.g. the file as of an older
commit) timed on the same buffers.

Per (shape, T): uniform random top-k routing, random bf16 weights in the model-file layout; moe_align and the bf16
gather once per block_m; then gate|up (SwiGLU epilogue) and down (store epilogue) timed by CUDA-graph replay
(device time only). TFLOP/s counts the routed rows' FLOPs only (padding rows are the kernel's overhead). Every
variant's y is compared with torch's per-expert bf16 reference (max |diff| / max |ref|).

    python bench/moe_gemm.py --out bench/results/h200-moe-gemm.json [--previous ab_old/moe_gemm_mma_prev.py]
                             [--shapes qwen3moe,mixtral] [--tokens 16,64,512,2048] [--configs m16,m64,...]
Prints, per case: µs and TFLOP/s of each config, the best, and ratios best / previous-best and best / cuBLAS.
On sm_90 the warpgroup-MMA kernel (kernels/moe_gemm_wgmma.py, "wgmma:" configs) is timed beside it.

--cublas-host: instead, the host time of one cublasGemmEx per mixtral expert (gate shape, M around 128) when M
is the same every call, new every call (ragged, as per-expert row counts are), or rounded up
(cuda/moe.py `cublas_rows`): cuBLAS chooses a kernel per unseen shape on the host.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernels import graph_timed, load_module, torch_timed  # noqa: E402

SHAPES = {"qwen3moe": dict(D=2048, F=768, E=128, K=8), "mixtral": dict(D=4096, F=14336, E=8, K=2)}


def variants(module):
    """Named configs to time: the module's CONFIGS plus shapes around them (more warps, other stage counts)."""
    C = module.Config
    out = dict(module.CONFIGS)
    if "nw" in C._fields:  # the wgmma kernel's: other warpgroup splits and stage counts
        out.update(
            {
                "w128n256": C(2, 1, 256, stages=4),
                "w64n256": C(1, 1, 256, stages=4),
                "w64s5": C(1, 2, 128, stages=5),  # 200 KB: 5 stages of 128 x 256 exceed the 227 KB an SM has
            }
        )
    elif "stages" in C._fields:  # neighbours of the named configs (H200 figures: docs/kernels.md)
        out.update(
            {
                "m64s4": C(2, 2, 2, 8, bk=32, stages=4),
                "m64w8": C(2, 4, 2, 4, bk=32, stages=3),
                "m128s4": C(2, 4, 4, 4, bk=32, stages=4),
                "m128w4": C(2, 2, 4, 8, bk=32, stages=4),
                "m64n256": C(2, 4, 2, 8, bk=32, stages=3),
                "m16s4": C(1, 4, 1, 4, bk=64, stages=4),
                "m32s4": C(1, 4, 2, 4, bk=64, stages=4),
            }
        )
    return out


def wgmma_module():
    """kernels/moe_gemm_wgmma behind moe_gemm_mma's launcher names (store combine only)."""
    from types import SimpleNamespace

    from expert_service.kernels import moe_gemm_wgmma as wg

    def down(h, tile_expert, num_tiles, sorted_ids, W, F, D, y, combine, config, stream):
        assert combine == "store"
        wg.launch_wgmma_down(h, tile_expert, num_tiles, sorted_ids, W, F, D, y, config=config, stream=stream)

    return SimpleNamespace(
        Config=wg.Config, CONFIGS=wg.CONFIGS, launch_moe_gemm_gate_up=wg.launch_wgmma_gate_up, launch_moe_gemm_down=down
    )


def cublas_host(out_path):
    """Host µs per cublasGemmEx (mixtral expert gate shape) for fixed, ragged and rounded row counts."""
    import time

    from numba import cuda

    from expert_service.cuda.cublas import WORKSPACE_BYTES, Cublas
    from expert_service.cuda.driver import device_address, non_blocking_stream
    from expert_service.cuda.moe import cublas_rows

    _, stream = non_blocking_stream()
    blas = Cublas(stream, cuda.device_array(WORKSPACE_BYTES, np.uint8))
    D, F, E = SHAPES["mixtral"]["D"], SHAPES["mixtral"]["F"], SHAPES["mixtral"]["E"]
    W = cuda.device_array((E, 3 * F * D), np.uint16)
    x, y = cuda.device_array((4096, D), np.uint16), cuda.device_array((4096, F), np.float32)
    w_addr = device_address(W) + np.arange(E, dtype=np.int64) * 3 * F * D * 2
    rng = np.random.default_rng(0)
    kinds = {
        "same": lambda: np.full(E, 128),
        "ragged": lambda: rng.integers(90, 170, E),
        "rounded": lambda: cublas_rows(rng.integers(90, 170, E), np.full(E, 4096)),
    }
    blas.linear_each(
        w_addr, np.full(E, device_address(x)), np.full(E, device_address(y)), np.full(E, 64), F, D, np.uint16
    )  # cuBLAS's own first-call set-up, outside the timings
    stream.synchronize()
    result = {}
    for kind, rows in kinds.items():
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(3):
                blas.linear_each(
                    w_addr,
                    np.full(E, device_address(x)),
                    np.full(E, device_address(y)),
                    rows().astype(np.int64),
                    F,
                    D,
                    np.uint16,
                )
            host = time.perf_counter() - start
            stream.synchronize()
            result.setdefault(kind, []).append(host / (3 * E) * 1e6)
        print(f"{kind:8s} host µs per cublasGemmEx, three rounds: " + ", ".join(f"{v:.1f}" for v in result[kind]))
    blas.close()
    Path(out_path).write_text(json.dumps({"host_us_per_gemm": result}, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="moe_gemm.json")
    ap.add_argument("--previous")
    ap.add_argument("--shapes", default="qwen3moe,mixtral")
    ap.add_argument("--tokens", default="16,64,512,2048")
    ap.add_argument("--configs", default="")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cublas-host", action="store_true")
    args = ap.parse_args()
    if args.cublas_host:
        return cublas_host(args.out)

    import torch
    from numba import cuda

    from expert_service.cuda.driver import non_blocking_stream
    from expert_service.kernels import moe_gemm_mma as current
    from expert_service.kernels.moe_align import launch_moe_align, launch_moe_gather_bf16, max_tiles

    _, stream = non_blocking_stream()
    modules = {"current": current}
    if torch.cuda.get_device_capability() >= (9, 0):
        modules["wgmma"] = wgmma_module()
    if args.previous:
        modules["previous"] = load_module(args.previous)
    wanted = set(filter(None, args.configs.split(",")))

    def graph_us(launch):
        return graph_timed(lambda i, q: launch(q), stream, args.reps) * 1e6

    def torch_us(fn):  # eager launches between two events, as transformers runs them
        return torch_timed(lambda i: fn(), args.reps, graph=False) * 1e6

    results = {"device": torch.cuda.get_device_name(), "cases": []}
    for shape in args.shapes.split(","):
        D, F, E, K = (SHAPES[shape][k] for k in "DFEK")
        stride = -(-3 * F * D * 2 // 4096) * 4096 // 2
        gen = torch.Generator(device="cuda").manual_seed(0)
        tw = torch.zeros(E, stride, dtype=torch.bfloat16, device="cuda")
        for e in range(E):
            tw[e, : 3 * F * D].normal_(0, D**-0.5, generator=gen)
        W = cuda.as_cuda_array(tw.view(torch.int16)).view(np.uint16)
        for T in map(int, args.tokens.split(",")):
            n = T * K
            ids_t = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices.to(torch.int32)
            x_t = torch.randn(T, D, device="cuda", generator=gen)
            ids, x = cuda.as_cuda_array(ids_t.contiguous()), cuda.as_cuda_array(x_t)
            # torch reference y [n, D] in assignment order, and the dense cuBLAS timing at M = n
            xb = x_t.to(torch.bfloat16)
            y_ref = torch.zeros(n, D, device="cuda")
            flat = ids_t.reshape(-1)
            for e in torch.unique(flat).tolist():
                rows = torch.nonzero(flat == e).squeeze(1)
                blk = tw[e]
                gate, up, down = (
                    blk[: F * D].view(F, D),
                    blk[F * D : 2 * F * D].view(F, D),
                    blk[2 * F * D : 3 * F * D].view(D, F),
                )
                xe = xb[rows // K]
                y_ref[rows] = ((torch.nn.functional.silu(xe @ gate.T) * (xe @ up.T)) @ down.T).float()
            dense_a = torch.randn(n, D, device="cuda").to(torch.bfloat16)
            dense_h = torch.randn(n, F, device="cuda").to(torch.bfloat16)
            gu_w, dn_w = tw[0, : 2 * F * D].view(2 * F, D), tw[0, 2 * F * D : 3 * F * D].view(D, F)
            flops_gu, flops_dn = 2.0 * n * D * 2 * F, 2.0 * n * F * D
            case = {
                "shape": shape,
                "T": T,
                "assignments": n,
                "experts_used": int(torch.unique(flat).numel()),
                "cublas_dense_us": {
                    "gate_up": torch_us(lambda: dense_a @ gu_w.T),
                    "down": torch_us(lambda: dense_h @ dn_w.T),
                },
                "variants": {},
            }
            for mod_name, mod in modules.items():
                for cfg_name, cfg in variants(mod).items():
                    if wanted and cfg_name not in wanted:
                        continue
                    key = f"{mod_name}:{cfg_name}"
                    try:
                        bm = cfg.block_m
                        tiles = max_tiles(n, E, bm)
                        rows = tiles * bm
                        sorted_ids, tile_expert = cuda.device_array(rows, np.int32), cuda.device_array(tiles, np.int32)
                        num_tiles, position = cuda.device_array(1, np.int32), cuda.device_array(n, np.int32)
                        xs = cuda.device_array((rows, D), np.uint16)
                        h = cuda.device_array((rows, F), np.uint16)
                        y = cuda.device_array((n, D), np.float32)
                        launch_moe_align(ids, E, bm, sorted_ids, tile_expert, num_tiles, position, stream=stream)
                        launch_moe_gather_bf16(x, sorted_ids, num_tiles, K, bm, xs, stream=stream)
                        gu = graph_us(
                            lambda q: mod.launch_moe_gemm_gate_up(
                                xs, tile_expert, num_tiles, W, F, D, h, config=cfg, stream=q
                            )
                        )
                        dn = graph_us(
                            lambda q: mod.launch_moe_gemm_down(
                                h, tile_expert, num_tiles, sorted_ids, W, F, D, y, combine="store", config=cfg, stream=q
                            )
                        )
                        stream.synchronize()
                        got = torch.as_tensor(y, device="cuda")
                        err = float((got - y_ref).abs().max() / y_ref.abs().max())
                        case["variants"][key] = {
                            "gate_up_us": gu,
                            "down_us": dn,
                            "total_us": gu + dn,
                            "tflops": (flops_gu + flops_dn) / (gu + dn) / 1e6,
                            "rel_err": err,
                            "config": list(cfg),
                            "shared_kb": getattr(cfg, "shared_bytes", 0) / 1024,
                        }
                    except Exception as exc:  # noqa: BLE001 -- a config that fails to build is reported, not fatal
                        case["variants"][key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            ok = {k: v for k, v in case["variants"].items() if "total_us" in v and v["rel_err"] < 2e-2}
            best = {
                m: min((v["total_us"], k) for k, v in ok.items() if k.startswith(m + ":"))
                for m in modules
                if any(k.startswith(m + ":") for k in ok)
            }
            dense = case["cublas_dense_us"]["gate_up"] + case["cublas_dense_us"]["down"]
            case["best"] = {m: {"config": k, "total_us": t} for m, (t, k) in best.items()}
            if "current" in best:
                case["best_vs_cublas_dense"] = dense / best["current"][0]
            if "current" in best and "previous" in best:
                case["speedup_vs_previous"] = best["previous"][0] / best["current"][0]
            if "current" in best and "wgmma" in best:
                case["wgmma_vs_current"] = best["current"][0] / best["wgmma"][0]
                case["wgmma_vs_cublas_dense"] = dense / best["wgmma"][0]
            results["cases"].append(case)
            print(
                f"\n{shape} T={T} (n={n}, experts {case['experts_used']}): cuBLAS dense {dense:.1f} us "
                f"({(flops_gu + flops_dn) / dense / 1e6:.0f} TFLOP/s)"
            )
            for k, v in case["variants"].items():
                if "error" in v:
                    print(f"  {k:24s} ERROR {v['error']}")
                else:
                    print(
                        f"  {k:24s} {v['gate_up_us']:9.1f} + {v['down_us']:9.1f} us  {v['tflops']:6.1f} TFLOP/s"
                        f"  err {v['rel_err']:.1e}"
                    )
            print(
                "  best:",
                {m: f"{b['config']} {b['total_us']:.1f} us" for m, b in case["best"].items()},
                {
                    k: round(case[k], 2)
                    for k in (
                        "speedup_vs_previous",
                        "best_vs_cublas_dense",
                        "wgmma_vs_current",
                        "wgmma_vs_cublas_dense",
                    )
                    if k in case
                },
            )
            Path(args.out).write_text(json.dumps(results, indent=1))
        del tw


if __name__ == "__main__":
    main()
