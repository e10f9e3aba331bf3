"""H200 benchmark of the grouped MoE GEMM, fused gate and two-pass argmax kernels (GPU):
`python bench/moe_gemm_mma.py [--tests] OUT.json`; --tests runs those kernels' GPU tests first, in this process.

MoE layer (ids / routing weights given, random bf16 weights in the model-file layout, random uniform top-k):
- grouped tensor-core path: moe_align -> moe_gather_bf16 -> moe_gemm_gate_up -> moe_gemm_down (atomic combine,
  or store + moe_combine), every named tile config; device time from CUDA-graph replay (it has no host sync),
  per kernel and for the sequence; eager wall time of the sequence.
- current prefill path (cuda/decoder.py `_experts_cublas`, rebuilt here from the same calls): expert_grouping,
  gather, offsets read back to the host (stream sync), cast, per active expert cublasGemmEx gate / up, silu_mul,
  cast, per expert down, moe_combine: eager wall time.
- transformers-style torch loop (per expert: where, index, bf16 F.linear x3, index_add_): eager wall time, and
  the reference the outputs are compared with.
- small steps (T = 16, 64): the grouped path at small M tiles vs the all-experts strided-batched cuBLAS path
  and the moe_ffn grouped kernels (graph replay each).
Decode kernels: gate_fused vs gemv/cuBLAS + gate_topk; greedy_split vs greedy (graph replay).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from numba import cuda

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from expert_service.cuda.cublas import WORKSPACE_BYTES, Cublas
from expert_service.cuda.driver import Graph, device_address, non_blocking_stream
from expert_service.kernels import elementwise
from expert_service.kernels.expert_grouping import launch_expert_grouping
from expert_service.kernels.gate_fused import launch_gate_fused
from expert_service.kernels.gate_topk import launch_gate_topk
from expert_service.kernels.gather import launch_gather_rows
from expert_service.kernels.gemv import launch_gemv
from expert_service.kernels.greedy import launch_greedy
from expert_service.kernels.greedy_split import launch_greedy_split, parts
from expert_service.kernels.moe_align import launch_moe_align, launch_moe_gather_bf16, max_tiles
from expert_service.kernels.moe_combine import launch_moe_combine
from expert_service.kernels.moe_combine_dense import launch_moe_combine_dense
from expert_service.kernels.moe_ffn import launch_moe_down, launch_moe_gate_up
from expert_service.kernels.moe_gemm_mma import CONFIGS, choose_config, launch_moe_gemm_down, launch_moe_gemm_gate_up

SHAPES = {"mixtral": dict(D=4096, F=14336, E=8, K=2), "qwen3moe": dict(D=2048, F=768, E=128, K=8)}
_, STREAM = non_blocking_stream()
RESULTS: dict = {"cases": [], "errors": []}
OUT_PATH = next((a for a in sys.argv[1:] if not a.startswith("--")), "/tmp/moe_gemm_bench.json")
TEST_FILES = [
    str(REPO / f"tests/expert_service/kernels/test_{n}.py")
    for n in ("moe_gemm_mma", "moe_align", "gate_fused", "greedy_split")
]


def save():
    with open(OUT_PATH, "w") as f:
        json.dump(RESULTS, f, indent=1)


def graph_ms(fn, reps=20):
    """Device ms per replay of a graph capturing fn() (fn already run eagerly once)."""
    fn()
    STREAM.synchronize()
    g = Graph(STREAM)
    with g:
        fn()
    g.replay()
    STREAM.synchronize()
    start, end = cuda.event(), cuda.event()
    start.record(STREAM)
    for _ in range(reps):
        g.replay()
    end.record(STREAM)
    end.synchronize()
    g.close()
    return cuda.event_elapsed_time(start, end) / reps


def eager_ms(fn, reps=10):
    fn()
    STREAM.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    STREAM.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def torch_view(a):
    return torch.as_tensor(a, device="cuda")


class Layer:
    """Random bf16 expert weights [E, stride] (numba uint16 + torch bf16 views of the same memory)."""

    def __init__(self, D, F, E, K, seed=0):
        self.D, self.F, self.E, self.K = D, F, E, K
        self.stride = -(-3 * F * D * 2 // 4096) * 4096 // 2
        raw = cuda.device_array((E, self.stride), np.int16)
        self.tw = torch_view(raw).view(torch.bfloat16)
        self.tw.zero_()
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for e in range(E):
            self.tw[e, : 3 * F * D].normal_(0, D**-0.5, generator=gen)
        self.W = raw.view(np.uint16)
        torch.cuda.synchronize()

    def mats(self, e):
        F, D = self.F, self.D
        blk = self.tw[e]
        return blk[: F * D].view(F, D), blk[F * D : 2 * F * D].view(F, D), blk[2 * F * D : 3 * F * D].view(D, F)


def routing(T, E, K, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(T, E, device="cuda", generator=gen)
    ids = scores.topk(K, dim=1).indices.to(torch.int32).contiguous()
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=gen), dim=1).contiguous()
    return ids, w


def torch_moe(layer, x, ids, w, residual):
    """transformers-style loop: per expert, its tokens, bf16 linears, weighted index_add_."""
    out = residual.clone()
    xb = x.to(torch.bfloat16)
    for e in range(layer.E):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        gate, up, down = layer.mats(e)
        xe = xb[tok]
        h = torch.nn.functional.silu(xe @ gate.T) * (xe @ up.T)
        y = (h @ down.T).float()
        out.index_add_(0, tok, y * w[tok, slot, None])
    return out


class Grouped:
    """The tensor-core path's buffers for one (layer, T, config)."""

    def __init__(self, layer, T, cfg):
        self.layer, self.T, self.cfg = layer, T, cfg
        n = T * layer.K
        self.n = n
        self.tiles = max_tiles(n, layer.E, cfg.block_m)
        rows = self.tiles * cfg.block_m
        self.sorted_ids = cuda.device_array(rows, np.int32)
        self.tile_expert = cuda.device_array(self.tiles, np.int32)
        self.num_tiles = cuda.device_array(1, np.int32)
        self.position = cuda.device_array(n, np.int32)
        self.xs = cuda.device_array((rows, layer.D), np.uint16)
        self.h = cuda.device_array((rows, layer.F), np.uint16)
        self.y = cuda.device_array((n, layer.D), np.float32)
        self.identity = cuda.to_device(np.arange(n, dtype=np.int32))

    def align(self, ids):
        launch_moe_align(
            ids,
            self.layer.E,
            self.cfg.block_m,
            self.sorted_ids,
            self.tile_expert,
            self.num_tiles,
            self.position,
            stream=STREAM,
        )

    def gather(self, x):
        launch_moe_gather_bf16(
            x, self.sorted_ids, self.num_tiles, self.layer.K, self.cfg.block_m, self.xs, stream=STREAM
        )

    def gate_up(self):
        L = self.layer
        launch_moe_gemm_gate_up(
            self.xs, self.tile_expert, self.num_tiles, L.W, L.F, L.D, self.h, config=self.cfg, stream=STREAM
        )

    def down_atomic(self, w, out):
        L = self.layer
        launch_moe_gemm_down(
            self.h,
            self.tile_expert,
            self.num_tiles,
            self.sorted_ids,
            L.W,
            L.F,
            L.D,
            out,
            route_weights=w,
            combine="atomic",
            config=self.cfg,
            stream=STREAM,
        )

    def down_store(self, w, out):
        L = self.layer
        launch_moe_gemm_down(
            self.h,
            self.tile_expert,
            self.num_tiles,
            self.sorted_ids,
            L.W,
            L.F,
            L.D,
            self.y,
            combine="store",
            config=self.cfg,
            stream=STREAM,
        )
        launch_moe_combine(self.y, self.identity, w, out, stream=STREAM)

    def run(self, ids, x, w, out, combine="atomic"):
        self.align(ids)
        self.gather(x)
        self.gate_up()
        (self.down_atomic if combine == "atomic" else self.down_store)(w, out)


class CublasPath:
    """decoder._experts_cublas and its surroundings (grouping, combine), same calls."""

    def __init__(self, layer, T, blas):
        self.layer, self.blas = layer, blas
        n = T * layer.K
        E = layer.E
        self.counts = cuda.device_array(E, np.int32)
        self.offsets = cuda.device_array(E + 1, np.int32)
        self.order = cuda.device_array(n, np.int32)
        self.position = cuda.device_array(n, np.int32)
        self.moe_in = cuda.device_array((n, layer.D), np.float32)
        self.cast = cuda.device_array(n * max(layer.D, layer.F), np.uint16)
        self.gate = cuda.device_array((n, layer.F), np.float32)
        self.up = cuda.device_array((n, layer.F), np.float32)
        self.out = cuda.device_array((n, layer.D), np.float32)
        self.host_offsets = cuda.pinned_array(E + 1, np.int32)

    def _as_bf16(self, a):
        rows, cols = a.shape
        c = self.cast[: rows * cols].reshape(rows, cols)
        elementwise.launch_cast(a, c, stream=STREAM)
        return c

    def run(self, ids, x, w, h):
        L = self.layer
        F, D, K = L.F, L.D, L.K
        launch_expert_grouping(ids, self.counts, self.offsets, self.order, self.position, stream=STREAM)
        launch_gather_rows(x, self.order, self.moe_in, divisor=K, stream=STREAM)
        self.offsets.copy_to_host(self.host_offsets, stream=STREAM)
        STREAM.synchronize()
        offsets = self.host_offsets
        active = np.flatnonzero(np.diff(offsets))
        lo, rows = offsets[active].astype(np.int64), np.diff(offsets)[active]
        item = 2
        gate = device_address(L.W) + active.astype(np.int64) * L.W.shape[1] * item
        xc = device_address(self._as_bf16(self.moe_in)) + lo * D * item
        self.blas.linear_each(gate, xc, device_address(self.gate) + lo * F * 4, rows, F, D, np.uint16)
        self.blas.linear_each(gate + F * D * item, xc, device_address(self.up) + lo * F * 4, rows, F, D, np.uint16)
        elementwise.launch_silu_mul(self.gate, self.up, self.gate, stream=STREAM)
        hc = device_address(self._as_bf16(self.gate)) + lo * F * item
        self.blas.linear_each(gate + 2 * F * D * item, hc, device_address(self.out) + lo * D * 4, rows, D, F, np.uint16)
        launch_moe_combine(self.out, self.position, w, h, stream=STREAM)


def rel_err(a, b):
    a, b = torch.as_tensor(a, device="cuda").float(), torch.as_tensor(b, device="cuda").float()
    return float((a - b).abs().max() / b.abs().max())


def bench_moe(name, T, blas, configs, small=False):
    s = SHAPES[name]
    layer = LAYERS[name]
    D, E, K = s["D"], s["E"], s["K"]
    ids_t, w_t = routing(T, E, K, seed=T)
    x_t = torch.randn(T, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(T + 1))
    res_t = torch.randn(T, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(T + 2))
    ids, w, x = cuda.as_cuda_array(ids_t), cuda.as_cuda_array(w_t), cuda.as_cuda_array(x_t)
    torch.cuda.synchronize()
    case = {"shape": name, "T": T, **s, "n_assignments": T * K, "active_experts": int(torch.unique(ids_t).numel())}
    ref = torch_moe(layer, x_t, ids_t, w_t, res_t)
    torch.cuda.synchronize()
    if not small:
        case["torch_loop_wall_ms"] = eager_ms(lambda: torch_moe(layer, x_t, ids_t, w_t, res_t), reps=5)
    out_t = res_t.clone()
    out = cuda.as_cuda_array(out_t)
    torch.cuda.synchronize()
    grouped = {}
    for cname in configs:
        cfg = CONFIGS[cname]
        g = Grouped(layer, T, cfg)
        entry = {"block_m": cfg.block_m, "max_tiles": g.tiles}
        try:
            for combine in ("atomic", "store"):
                out_t.copy_(res_t)
                torch.cuda.synchronize()
                g.run(ids, x, w, out, combine)
                STREAM.synchronize()
                entry[f"rel_err_vs_torch_{combine}"] = rel_err(out_t, ref)
                entry[f"graph_ms_{combine}"] = graph_ms(lambda: g.run(ids, x, w, out, combine))
            entry["used_tiles"] = int(g.num_tiles.copy_to_host()[0])
            entry["graph_ms_align"] = graph_ms(lambda: g.align(ids))
            entry["graph_ms_gather"] = graph_ms(lambda: g.gather(x))
            entry["graph_ms_gate_up"] = graph_ms(g.gate_up)
            entry["graph_ms_down_atomic"] = graph_ms(lambda: g.down_atomic(w, out))
            entry["graph_ms_down_store"] = graph_ms(lambda: g.down_store(w, out))
            entry["eager_wall_ms_atomic"] = eager_ms(lambda: g.run(ids, x, w, out, "atomic"))
            flops = 2 * T * K * 3 * s["F"] * D
            entry["tflops_gate_up_plus_down"] = (
                flops / ((entry["graph_ms_gate_up"] + entry["graph_ms_down_atomic"]) * 1e-3) / 1e12
            )
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"
            RESULTS["errors"].append(traceback.format_exc())
        grouped[cname] = entry
        print(name, T, cname, entry, flush=True)
    case["grouped"] = grouped
    try:
        if not small:
            cb = CublasPath(layer, T, blas)
            out_t.copy_(res_t)
            torch.cuda.synchronize()
            cb.run(ids, x, w, out)
            STREAM.synchronize()
            case["cublas_rel_err_vs_torch"] = rel_err(out_t, ref)
            case["cublas_per_expert_wall_ms"] = eager_ms(lambda: cb.run(ids, x, w, out))
        else:
            case.update(small_step_paths(layer, T, ids, x, w, out, blas))
    except Exception as e:
        case["cublas_error"] = f"{type(e).__name__}: {e}"
        RESULTS["errors"].append(traceback.format_exc())
    auto = choose_config(T * K, E)
    case["auto_config_block_m"] = auto.block_m
    RESULTS["cases"].append(case)
    print(json.dumps({k: v for k, v in case.items() if k != "grouped"}), flush=True)
    save()


def small_step_paths(layer, T, ids, x, w, out, blas):
    """Decode-sized steps: all experts by strided-batched cuBLAS (+ combine_dense), and moe_ffn grouped."""
    L, E, K, F, D = layer, layer.E, layer.K, layer.F, layer.D
    r = {}
    xc = cuda.device_array((T, D), np.uint16)
    gate = cuda.device_array(E * T * F, np.float32)
    up = cuda.device_array(E * T * F, np.float32)
    hc = cuda.device_array((E * T, F), np.uint16)
    y = cuda.device_array(E * T * D, np.float32)
    flat = L.W.reshape(-1)
    stride = L.W.shape[1]

    def all_experts():
        elementwise.launch_cast(x, xc, stream=STREAM)
        blas.linear_batched(xc, 0, flat, 0, stride, F, D, gate, T * F, E, T)
        blas.linear_batched(xc, 0, flat, F * D, stride, F, D, up, T * F, E, T)
        elementwise.launch_silu_mul(gate, up, gate, stream=STREAM)
        elementwise.launch_cast(gate.reshape(E * T, F), hc, stream=STREAM)
        blas.linear_batched(hc, T * F, flat, 2 * F * D, stride, D, F, y, T * D, E, T)
        launch_moe_combine_dense(y.reshape(E, T, D), ids, w, out, stream=STREAM)

    r["all_experts_cublas_graph_ms"] = graph_ms(all_experts)
    n = T * K
    counts, offsets = cuda.device_array(E, np.int32), cuda.device_array(E + 1, np.int32)
    order, position = cuda.device_array(n, np.int32), cuda.device_array(n, np.int32)
    h32, y32 = cuda.device_array((n, F), np.float32), cuda.device_array((n, D), np.float32)

    def moe_ffn():
        launch_expert_grouping(ids, counts, offsets, order, position, stream=STREAM)
        launch_moe_gate_up(x, order, offsets, L.W, F, D, h32, stream=STREAM)
        launch_moe_down(h32, order, offsets, L.W, F, D, y32, stream=STREAM)
        launch_moe_combine(y32, position, w, out, stream=STREAM)

    r["moe_ffn_grouped_graph_ms"] = graph_ms(moe_ffn)
    return r


def bench_router(blas):
    rows = []
    for name, s in SHAPES.items():
        D, E, K = s["D"], s["E"], s["K"]
        wr = cuda.device_array((E, D), np.int16)
        torch_view(wr).view(torch.bfloat16).normal_(0, D**-0.5)
        wr = wr.view(np.uint16)
        for T in (1, 16, 64):
            x = cuda.as_cuda_array(torch.randn(T, D, device="cuda"))
            ids = cuda.device_array((T, K), np.int32)
            ws = cuda.device_array((T, K), np.float32)
            ids2 = cuda.device_array((T, K), np.int32)
            ws2 = cuda.device_array((T, K), np.float32)
            logits = cuda.device_array((T, E), np.float32)
            logits2 = cuda.device_array((T, E), np.float32)
            counter = cuda.to_device(np.zeros(T, np.int32))
            xc = cuda.device_array((T, D), np.uint16)
            torch.cuda.synchronize()

            def current():
                if T == 1:
                    launch_gemv(x, wr, logits, stream=STREAM)
                else:
                    elementwise.launch_cast(x, xc, stream=STREAM)
                    blas.linear(xc, wr, logits)
                launch_gate_topk(logits, ids, ws, True, stream=STREAM)

            def fused():
                launch_gate_fused(x, wr, ids2, ws2, True, logits2, counter, stream=STREAM)

            row = {
                "shape": name,
                "T": T,
                "current_graph_us": 1e3 * graph_ms(current, 50),
                "fused_graph_us": 1e3 * graph_ms(fused, 50),
            }
            current()
            fused()
            STREAM.synchronize()
            row["ids_equal"] = bool((ids.copy_to_host() == ids2.copy_to_host()).all())
            row["counter_zero"] = bool((counter.copy_to_host() == 0).all())
            row["max_logit_diff"] = float(np.abs(logits.copy_to_host() - logits2.copy_to_host()).max())
            row["max_weight_diff"] = float(np.abs(ws.copy_to_host() - ws2.copy_to_host()).max())
            rows.append(row)
            print(row, flush=True)
    RESULTS["router"] = rows
    save()


def bench_greedy():
    rows = []
    for V in (32000, 151936):
        for S in (1, 16, 64):
            logits = cuda.as_cuda_array(torch.randn(S, V, device="cuda"))
            ids, flags = cuda.device_array(S, np.int32), cuda.device_array(S, np.int32)
            ids2, flags2 = cuda.device_array(S, np.int32), cuda.device_array(S, np.int32)
            p = parts(V)
            pv, pi, pf = (cuda.device_array((S, p), dt) for dt in (np.float32, np.int32, np.int32))
            torch.cuda.synchronize()
            row = {
                "V": V,
                "S": S,
                "greedy_graph_us": 1e3 * graph_ms(lambda: launch_greedy(logits, ids, flags, stream=STREAM), 50),
                "split_graph_us": 1e3
                * graph_ms(lambda: launch_greedy_split(logits, ids2, flags2, pv, pi, pf, stream=STREAM), 50),
            }
            STREAM.synchronize()
            row["ids_equal"] = bool((ids.copy_to_host() == ids2.copy_to_host()).all())
            rows.append(row)
            print(row, flush=True)
    RESULTS["greedy"] = rows
    save()


LAYERS: dict = {}
BIG_CONFIGS = {"mixtral": ["m64", "m128"], "qwen3moe": ["m32", "m64"]}


def main():
    if "--tests" in sys.argv:  # GPU tests first, in this process: the bench reuses their compiled kernels
        import pytest

        RESULTS["pytest_exit"] = int(
            pytest.main(["-q", "-p", "no:cacheprovider", "-m", "gpu or not gpu", "-rf", "--timeout=300", *TEST_FILES])
        )
        save()
    RESULTS["device"] = torch.cuda.get_device_name()
    workspace = cuda.device_array(WORKSPACE_BYTES, np.uint8)
    blas = Cublas(STREAM, workspace)
    for part in (bench_greedy, bench_router):
        try:
            part() if part is bench_greedy else part(blas)
        except Exception:
            RESULTS["errors"].append(traceback.format_exc())
            save()
    for name, s in SHAPES.items():
        LAYERS[name] = Layer(s["D"], s["F"], s["E"], s["K"])
        for T in (512, 2048):
            try:
                bench_moe(name, T, blas, BIG_CONFIGS[name])
            except Exception:
                RESULTS["errors"].append(traceback.format_exc())
                save()
        for T in (16, 64):
            try:
                bench_moe(name, T, blas, ["m16"], small=True)
            except Exception:
                RESULTS["errors"].append(traceback.format_exc())
                save()
        del LAYERS[name]
        torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
