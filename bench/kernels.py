"""One-token (decode, b = 1) GEMV kernels of expert_service.kernels.gemv against references, in one run (GPU).

At the mixtral and qwen3 decode shapes (bf16 weights), every matrix one decode step reads:
- dense (q_proj, o_proj, kv_proj, router, lm_head; mixtral also swiglu_dense, a mixtral-sized dense MLP):
  launch_gemv / launch_gemv_swiglu against PyTorch (cuBLAS) on the same device memory:
  torch.nn.functional.linear(x_bf16, W), and for SwiGLU two linears + silu * mul, as Hugging Face does;
- experts (expert_gate_up, expert_down: the top-k experts of one token): launch_expert_gate_up /
  launch_expert_down against the grouped kernels moe_ffn.moe_gate_up / launch_moe_down (still used for T > 1).
Times are GPU time only: `--repeats` launches captured in one CUDA graph (Numba side: driver.Graph; torch side:
torch.cuda.CUDAGraph) and replayed between two events. Weights rotate over copies / expert sets (L2_FLUSH bytes,
more than the H200's 50 MB L2), so every byte comes from HBM. torch is also timed with eager launches
(`ref_eager_ms`: what an ungraphed decode pays; launch cost dominates the small matrices).

One line per case: MB read, gemv ms and TB/s, reference ms and TB/s, ratio = reference time / gemv time
(> 1: gemv faster), HBM roofline fraction = bytes / this GPU's streaming HBM read rate / time (bench/hbm_rate.py,
measured at the start of the run; --hbm-bytes-per-s to override), and max |gemv - ref| / max |ref| (torch returns
bf16, so ~1e-2 is expected; moe_ffn is fp32, ~1e-6). JSON is written to --out after each model.
`--sweep` adds the gemv kernels' TB/s under other launch shapes (LaunchShape) and LOADS_IN_FLIGHT 4 / 16.

    python bench/kernels.py --out out/kernels.json [--sweep]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import hbm_rate  # noqa: E402

L2_FLUSH = 192 << 20  # weight bytes cycled through per measurement (H200 L2: 50 MB)
SHAPES = {  # decode shapes: hidden D, expert F, experts E, top-k K, vocab V, q / kv widths
    "mixtral": dict(D=4096, F=14336, E=8, K=2, V=32000, Q=4096, KV=1024),
    "qwen3": dict(D=2048, F=768, E=128, K=8, V=151936, Q=4096, KV=512),
}


class Case(NamedTuple):
    nbytes: int  # weight bytes one launch reads
    gemv: Callable  # gemv(i, stream, shape=None): launch on weight copy / expert set i
    y: Any  # gemv's output (device)
    torch_ref: Callable | None = None  # dense: torch_ref(i) -> bf16 tensor
    moe_ref: Callable | None = None  # experts: moe_ref(i, stream) writes moe_y
    moe_y: Any = None


def graph_timed(launch, stream, repeats: int) -> float:
    """Seconds per launch of launch(i, stream), GPU time only: `repeats` launches (i = 0..repeats-1) captured
    in one CUDA graph and replayed between two events, so Numba's dispatcher cost is not counted."""
    from expert_service.cuda.driver import Graph

    launch(0, stream)  # compiles outside the capture
    stream.synchronize()
    with Graph(stream) as graph:
        for i in range(repeats):
            launch(i, stream)
    graph.replay()
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    graph.replay()
    end.record(stream)
    end.synchronize()
    graph.close()
    return cuda.event_elapsed_time(start, end) / repeats * 1e-3


def torch_timed(fn, repeats: int, graph: bool) -> float:
    """Seconds per fn(i) (i = 0..repeats-1) on torch's current stream: captured in a torch CUDA graph like
    graph_timed (graph=True), or eager launches between the events (includes the CPU launch cost)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (cuBLAS handle, workspace) off the capture, as torch asks
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for i in range(repeats):
                fn(i)
        captured.replay()
        start.record()
        captured.replay()
    else:
        start.record()
        for i in range(repeats):
            fn(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats * 1e-3


def load_module(path):
    """A kernel module from a file (an earlier version of it, for `--previous` comparisons in the same run)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem + "_previous", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@cuda.jit
def fill_bf16(w, seed):
    """w flat uint16: hashed bf16 bits, |v| in [2^-7, 2): finite, and no host RNG for GBs of weights."""
    i = cuda.grid(1)
    if i < w.size:
        h = (i * 2654435761 + seed) % 4294967296
        w[i] = np.uint16(0x3C00 | ((h >> 7) & 0x3FF) | (((h >> 20) & 1) << 15))


def expert_sets(rng, n_experts: int, top_k: int, n_sets: int) -> list:
    """n_sets expert-id arrays [1, top_k] int32, sorted and distinct (grouped order == slot order, so the
    moe_ffn reference's rows line up with gemv's). Built C-contiguous: a `[None]` view has a stride-0 leading
    axis, and Numba's device reshape of it fails ("operation requires copying")."""
    return [
        np.sort(rng.choice(n_experts, top_k, replace=False)).astype(np.int32).reshape(1, top_k).copy()
        for _ in range(n_sets)
    ]


def rel_diff(got, want) -> float:
    """max |got - want| / max |want|, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def summarize(nbytes: int, reference: str, t_gemv: float, t_ref: float, diff: float, hbm_bytes_per_s: float) -> dict:
    """One case's JSON entry from seconds per launch; the roofline fractions are of `hbm_bytes_per_s`."""
    return {
        "bytes": nbytes,
        "reference": reference,
        "gemv_ms": t_gemv * 1e3,
        "ref_ms": t_ref * 1e3,
        "gemv_TB_per_s": nbytes / t_gemv / 1e12,
        "ref_TB_per_s": nbytes / t_ref / 1e12,
        "ratio": t_ref / t_gemv,
        "gemv_roofline": nbytes / hbm_bytes_per_s / t_gemv,
        "ref_roofline": nbytes / hbm_bytes_per_s / t_ref,
        "max_rel_diff": diff,
    }


def format_row(model: str, name: str, r: dict) -> str:
    return (
        f"{model:8s} {name:15s} {r['bytes'] / 1e6:8.1f} MB  gemv {r['gemv_ms']:8.4f} ms "
        f"{r['gemv_TB_per_s']:5.2f} TB/s  {r['reference']:5s} {r['ref_ms']:8.4f} ms {r['ref_TB_per_s']:5.2f} TB/s"
        f"  ratio x{r['ratio']:5.2f}  roofline {r['gemv_roofline']:4.2f} (ref {r['ref_roofline']:4.2f})"
        f"  diff {r['max_rel_diff']:.1e}"
    )


def build_cases(s: dict, st, dense_mlp: bool) -> dict:
    """Case per decode matrix of shape dict s; weights filled on st (synchronize before torch reads them)."""
    import torch

    from expert_service.experts.grouping import group_by_expert
    from expert_service.kernels import gemv
    from expert_service.kernels.moe_ffn import launch_moe_down, launch_moe_gate_up

    linear, silu = torch.nn.functional.linear, torch.nn.functional.silu
    seed = iter(range(1, 1 << 30, 7919))

    def weights(shape):
        w = cuda.device_array(shape, np.uint16)
        flat = w.reshape(w.size)
        fill_bf16[-(-w.size // 256), 256, st](flat, next(seed))
        return w

    def dense_set(n, k):
        """Copies of one [n, k] matrix, enough to cycle past L2."""
        return [weights((n, k)) for _ in range(min(16, -(-L2_FLUSH // (n * k * 2))))]

    def as_bf16(a):  # zero-copy torch view of a Numba uint16 (bf16 bits) array
        return torch.as_tensor(a, device="cuda").view(torch.bfloat16)

    D, F, E, K = s["D"], s["F"], s["E"], s["K"]
    rng = np.random.default_rng(0)
    x = cuda.to_device(rng.standard_normal((1, D)).astype(np.float32))
    xq = cuda.to_device(rng.standard_normal((1, s["Q"])).astype(np.float32))
    x_bf16 = torch.as_tensor(x, device="cuda").to(torch.bfloat16)  # cast once, outside the timing
    xq_bf16 = torch.as_tensor(xq, device="cuda").to(torch.bfloat16)
    cases = {}
    dense = {
        "q_proj": (dense_set(s["Q"], D), x, x_bf16),
        "o_proj": (dense_set(D, s["Q"]), xq, xq_bf16),
        "kv_proj": (dense_set(s["KV"], D), x, x_bf16),
        "router": (dense_set(E, D), x, x_bf16),
        "lm_head": (dense_set(s["V"], D), x, x_bf16),
    }
    for name, (ws, xin, xb) in dense.items():
        n, tw = ws[0].shape[0], [as_bf16(w) for w in ws]
        y = cuda.device_array((1, n), np.float32)
        cases[name] = Case(
            n * ws[0].shape[1] * 2,
            lambda i, q, shape=None, ws=ws, xin=xin, y=y: gemv.launch_gemv(
                xin, ws[i % len(ws)], y, stream=q, shape=shape
            ),
            y,
            torch_ref=lambda i, tw=tw, xb=xb: linear(xb, tw[i % len(tw)]),
        )
    if dense_mlp:  # gate rows then up rows in one [2F, D] matrix (the fused-gate form)
        gus = dense_set(2 * F, D)
        tgu = [as_bf16(w) for w in gus]
        h = cuda.device_array((1, F), np.float32)

        def swiglu_torch(i):
            w = tgu[i % len(tgu)]
            return silu(linear(x_bf16, w[:F])) * linear(x_bf16, w[F:])

        cases["swiglu_dense"] = Case(
            2 * F * D * 2,
            lambda i, q, shape=None: gemv.launch_gemv_swiglu(x, gus[i % len(gus)], None, h, stream=q, shape=shape),
            h,
            torch_ref=swiglu_torch,
        )
    experts = weights((E, 3 * F * D))
    # distinct expert sets, cycled so L2 holds none of them
    sets = expert_sets(rng, E, K, min(8, E // K))
    ids = [cuda.to_device(i) for i in sets]
    groups = [group_by_expert(i, E) for i in sets]
    order = [cuda.to_device(g.order.astype(np.int32)) for g in groups]
    offsets = [cuda.to_device(g.offsets.astype(np.int32)) for g in groups]
    n_sets = len(sets)
    hg, hg_ref = cuda.device_array((K, F), np.float32), cuda.device_array((K, F), np.float32)
    ye, ye_ref = cuda.device_array((K, D), np.float32), cuda.device_array((K, D), np.float32)
    cases["expert_gate_up"] = Case(
        K * 2 * F * D * 2,
        lambda i, q, shape=None: gemv.launch_expert_gate_up(
            x, ids[i % n_sets], experts, F, D, hg, stream=q, shape=shape
        ),
        hg,
        moe_ref=lambda i, q: launch_moe_gate_up(
            x, order[i % n_sets], offsets[i % n_sets], experts, F, D, hg_ref, stream=q
        ),
        moe_y=hg_ref,
    )
    # both down kernels read hg_ref, written by the gate_up reference (measured first: dict order)
    cases["expert_down"] = Case(
        K * F * D * 2,
        lambda i, q, shape=None: gemv.launch_expert_down(
            hg_ref, ids[i % n_sets], experts, F, D, ye, stream=q, shape=shape
        ),
        ye,
        moe_ref=lambda i, q: launch_moe_down(
            hg_ref, order[i % n_sets], offsets[i % n_sets], experts, F, D, ye_ref, stream=q
        ),
        moe_y=ye_ref,
    )
    return cases


def measure(case: Case, st, repeats: int, hbm_bytes_per_s: float) -> dict:
    """Times gemv and its reference over the same rotation; diff from one launch each on copy / set 0."""
    t_gemv = graph_timed(case.gemv, st, repeats)
    case.gemv(0, st)
    got = case.y.copy_to_host(stream=st)
    st.synchronize()
    if case.torch_ref is not None:
        t_ref = torch_timed(case.torch_ref, repeats, graph=True)
        t_eager = torch_timed(case.torch_ref, repeats, graph=False)
        want = case.torch_ref(0).float().cpu().numpy()
        entry = summarize(case.nbytes, "torch", t_gemv, t_ref, rel_diff(got, want), hbm_bytes_per_s)
        entry["ref_eager_ms"] = t_eager * 1e3
        return entry
    t_ref = graph_timed(case.moe_ref, st, repeats)
    case.moe_ref(0, st)
    want = case.moe_y.copy_to_host(stream=st)
    st.synchronize()
    return summarize(case.nbytes, "moe", t_gemv, t_ref, rel_diff(got, want), hbm_bytes_per_s)


def _sweep(cases, st, repeats):
    """TB/s of the new kernels under other launch shapes (LaunchShape(rows, split, groups)) and LOADS_IN_FLIGHT."""
    from expert_service.kernels import gemv
    from expert_service.kernels.gemv import LaunchShape

    shapes = {
        False: [
            LaunchShape(4, 1, 4),
            LaunchShape(4, 1, 2),
            LaunchShape(4, 2, 2),
            LaunchShape(2, 1, 4),
            LaunchShape(2, 2, 2),
            LaunchShape(1, 1, 4),
            LaunchShape(1, 4, 1),
        ],
        True: [
            LaunchShape(2, 1, 4),
            LaunchShape(2, 1, 2),
            LaunchShape(2, 2, 2),
            LaunchShape(1, 1, 4),
            LaunchShape(1, 2, 2),
        ],
    }
    names = [n for n in ("q_proj", "kv_proj", "lm_head", "swiglu_dense", "expert_gate_up", "expert_down") if n in cases]
    out = {name: {} for name in names}
    for name in names:
        nbytes, launch = cases[name].nbytes, cases[name].gemv
        for shape in shapes[name in ("swiglu_dense", "expert_gate_up")]:
            t = graph_timed(lambda i, q, p=shape, launch=launch: launch(i, q, shape=p), st, repeats)
            out[name][str(tuple(shape))] = nbytes / t / 1e12
    default = gemv.LOADS_IN_FLIGHT
    for lif in (4, 16):  # module constant read when a variant is built: rebuild all
        gemv.LOADS_IN_FLIGHT = lif
        gemv._build.cache_clear()
        for name in ("lm_head", "expert_gate_up", "expert_down"):
            out[name][f"loads_in_flight={lif}"] = cases[name].nbytes / graph_timed(cases[name].gemv, st, repeats) / 1e12
    gemv.LOADS_IN_FLIGHT = default
    gemv._build.cache_clear()
    for name in names:
        print("sweep", name, json.dumps({k: round(v, 3) for k, v in out[name].items()}), flush=True)
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/kernels.json")
    parser.add_argument("--repeats", type=int, default=20, help="launches per timed graph / event pair")
    parser.add_argument("--sweep", action="store_true", help="also launch-shape and LOADS_IN_FLIGHT variants")
    parser.add_argument("--gemv", action="store_true", help=argparse.SUPPRESS)  # old command lines: no-op
    hbm_rate.add_argument(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from expert_service.cuda.driver import non_blocking_stream

    args = parse_args(argv)
    roofline = hbm_rate.roofline(args.hbm_bytes_per_s)
    print(roofline.summary(), flush=True)
    _, st = non_blocking_stream()
    results = {
        **roofline.record(),
        "repeats": args.repeats,
        "models": {},
    }
    for model, shape in SHAPES.items():
        cases = build_cases(shape, st, dense_mlp=model == "mixtral")
        st.synchronize()  # torch reads the weights on its own stream
        out = {}
        for name, case in cases.items():
            out[name] = measure(case, st, args.repeats, roofline.bytes_per_s)
            print(format_row(model, name, out[name]), flush=True)
        if args.sweep:
            out["sweep"] = _sweep(cases, st, args.repeats)
        results["models"][model] = out
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
