"""Does warming the L2 ahead of a one-token weight stream shorten it? One run on one GPU (kernels/l2_prefetch.py).

A decode step at one token is a chain of short kernels; the weight-streaming ones (GEMV, linear_q8, the 8-bit
experts) wait a memory latency for their first bytes and leave the HBM idle while they ramp up and drain, and the
kernels between them (norms, attention at a short context, the router) read almost nothing. Here each "layer" is
   [prefetch of the layer's weights] -> a stand-in for those kernels (one warp spinning SPIN us) -> the consumer
with the consumer one of: bf16 `gemv` of an [N, K] matrix, `linear_q8` of the same matrix in int8, or the int8
experts of a qwen3moe-shape layer at one token (moe_q8 gate/up + down over 8 of 128 experts; the prefetch
reads the picked experts' blocks from the device ids, as the engine's would after its router). The layers cycle
through enough copies of the weights that none is in L2 from an earlier layer; the chain is captured in one CUDA
graph and replayed between two events. Printed per case: the consumer's microseconds a layer (the chain's time
minus the same chain without the consumer), with and without the prefetch, and the ratio.

    python bench/l2_prefetch.py --out out/l2_prefetch.json [--spins 0,4,10]

`--smoke` runs tiny shapes under NUMBA_ENABLE_CUDASIM=1 (times mean nothing there).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np
from numba import config, cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.q8_kernels import random_layer  # noqa: E402

MATRICES = {"qwen3-o": (2048, 4096), "qwen3-qkv": (5120, 2048), "mixtral-o": (4096, 4096)}
COPIES_BYTES = 320 << 20  # weight bytes a chain cycles through: several times the 50-60 MB L2
LAYERS = 48
SIMULATOR = bool(config.ENABLE_CUDASIM)


@cuda.jit
def spin(ns):
    """One warp asleep for roughly ns nanoseconds (the kernels between two weight streams; its real length is
    measured: nanosleep sleeps between zero and twice its argument)."""
    for _ in range(ns // 200):
        if not SIMULATOR:  # the simulator has no nanosleep
            cuda.nanosleep(200)


def bf16_bits(w: np.ndarray) -> np.ndarray:
    return (w.view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def dense_case(name, rng, stream, code):
    """(launch(j, stream), prefetch(j, stream), bytes a layer) for the matrix `name` in bf16 (code None) or 8 bits."""
    from expert_service.kernels import expert_quant as q
    from expert_service.kernels import l2_prefetch
    from expert_service.kernels.gemv import launch_gemv
    from expert_service.kernels.linear_q8 import launch_linear_q8, matrix_meta, row_bounds

    N, K = MATRICES[name]
    w = (rng.standard_normal((N, K), dtype=np.float32) * 0.02).astype(np.float32)
    if code is None:
        raw = bf16_bits(w).view(np.uint8).reshape(-1)
        at = raw.size
    else:
        codes, scale = q.quantize(w, code, q.SCALE_CHANNEL)
        at = -(-codes.size // 64) * 64
        raw = np.zeros(at + scale.nbytes, np.uint8)
        raw[: codes.size], raw[at:] = codes.reshape(-1), scale.view(np.uint8)
    nbytes = -(-raw.size // 16) * 16
    copies = max(2, COPIES_BYTES // nbytes)
    buf = np.zeros(copies * nbytes, np.uint8)
    for c in range(copies):
        buf[c * nbytes : c * nbytes + raw.size] = raw
    dev = cuda.to_device(buf, stream=stream)
    tables = [
        cuda.to_device(l2_prefetch.check_ranges([[c * nbytes, nbytes]], buf.size), stream=stream) for c in range(copies)
    ]
    x = cuda.to_device(rng.standard_normal((1, K), dtype=np.float32), stream=stream)
    out = cuda.device_array((1, N), np.float32, stream=stream)
    if code is None:
        mats = [dev[c * nbytes : c * nbytes + N * K * 2].view(np.uint16).reshape(N, K) for c in range(copies)]

        def launch(j, s):
            launch_gemv(x, mats[j % copies], out, stream=s)
    else:
        meta = cuda.to_device(matrix_meta(code, at), stream=stream)
        blocks = [dev[c * nbytes : (c + 1) * nbytes] for c in range(copies)]
        bounds = cuda.to_device(row_bounds(1), stream=stream)

        def launch(j, s):  # meta read on the device, as the engine's default launches
            launch_linear_q8(x, blocks[j % copies], meta, code, N, out, bounds, stream=s)

    def prefetch(j, s):
        l2_prefetch.launch_prefetch(dev, tables[j % copies], stream=s)

    return launch, prefetch, raw.size


def experts_case(rng, stream, shape, code, down_only: bool):
    """qwen3moe-shape experts at one token, 8-bit (moe_q8) or bf16 (code None: gemv's expert kernels): launch,
    prefetch (the picked blocks, or only their down rows and scales), bytes a layer."""
    from expert_service.kernels import expert_quant as q
    from expert_service.kernels import l2_prefetch
    from expert_service.kernels.gemv import launch_expert_down, launch_expert_gate_up
    from expert_service.kernels.moe_q8 import launch_q8_down, launch_q8_gate_up

    D, F, E, K = shape
    if code is None:
        blocks = bf16_bits(rng.standard_normal((E, 3 * F * D), dtype=np.float32) * np.float32(0.02))
        offs = (0, 2 * F * D, 2 * 2 * F * D, 3 * 2 * F * D)
        used_lo, used_hi = (offs[2] if down_only else 0), offs[3]
    else:
        blocks, meta, offs = random_layer(rng, code, q.SCALE_CHANNEL, E, F, D)
        meta_d = cuda.to_device(meta, stream=stream)
        used_lo, used_hi = (offs[2] if down_only else 0), -(-offs[6] // 16) * 16
    copies = max(2, COPIES_BYTES // blocks.nbytes)
    devs = [cuda.to_device(blocks, stream=stream) for _ in range(copies)]
    # fresh picks every layer: with two copies of a 600 MB layer, fixed picks would be read again two layers on,
    # from L2
    ids = [
        cuda.to_device(rng.choice(E, K, replace=False).astype(np.int32).reshape(1, K), stream=stream)
        for _ in range(LAYERS)
    ]
    x = cuda.to_device(rng.standard_normal((1, D), dtype=np.float32), stream=stream)
    h = cuda.device_array((K, F), np.float32, stream=stream)
    y = cuda.device_array((K, D), np.float32, stream=stream)
    kinds = ((code, q.SCALE_CHANNEL),)
    none = cuda.to_device(np.zeros((1, 2), np.int64), stream=stream)  # no dense ranges: the picks only

    def launch(j, s):
        c, picks = j % copies, ids[j % len(ids)]
        if code is None:
            launch_expert_gate_up(x, picks, devs[c], F, D, h, stream=s)
            launch_expert_down(h, picks, devs[c], F, D, y, stream=s)
        else:
            launch_q8_gate_up(x, devs[c], meta_d, F, D, h, ids=picks, stream=s, kinds=kinds)
            launch_q8_down(h, devs[c], meta_d, F, D, y, ids=picks, stream=s, kinds=kinds)

    def prefetch(j, s):
        c, picks = j % copies, ids[j % len(ids)]
        l2_prefetch.launch_prefetch(devs[c], none, experts=devs[c], ids=picks, lo=used_lo, hi=used_hi, stream=s)

    return launch, prefetch, K * (offs[3] if code is None else offs[6])


def chain_us(stream, layers, spin_ns, launch=None, prefetch=None) -> float:
    from bench.kernels import graph_timed

    def one(j, s):
        if prefetch is not None:
            prefetch(j, s)
        if spin_ns:
            spin[1, 32, s](np.int64(spin_ns))
        if launch is not None:
            launch(j, s)

    if config.ENABLE_CUDASIM:
        t0 = time.perf_counter()
        for j in range(layers):
            one(j, stream)
        return (time.perf_counter() - t0) / layers * 1e6
    return graph_timed(one, stream, layers) * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="l2_prefetch.json")
    parser.add_argument("--spins", default="0,4,10", help="microseconds of the stand-in kernels between streams")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (simulator)")
    parser.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
    args = parser.parse_args(argv)
    from expert_service.kernels import expert_quant as q

    spins = [int(float(s) * 1000) for s in args.spins.split(",")]
    layers = 4 if args.smoke else LAYERS
    if args.smoke:
        global COPIES_BYTES
        MATRICES.clear()
        MATRICES["tiny"] = (64, 128)
        COPIES_BYTES = 1 << 16
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    # each case built only if run (a bf16 expert layer is 1.2 GB of random values)
    makers = {}
    for name in MATRICES:
        makers[f"{name}-bf16"] = functools.partial(dense_case, name, rng, stream, None)
        makers[f"{name}-int8"] = functools.partial(dense_case, name, rng, stream, q.CODE_INT8)
    experts = (64, 48, 4, 2) if args.smoke else (2048, 768, 128, 8)
    for code, label in ((q.CODE_INT8, "int8"), (None, "bf16")):
        for down_only in (False, True):
            name = f"qwen3-experts-{label}{'-warm-down' if down_only else ''}"
            makers[name] = functools.partial(experts_case, rng, stream, experts, code, down_only)
    wanted = args.cases.split(",") if args.cases else list(makers)
    if unknown := set(wanted) - set(makers):
        parser.error(f"--cases: unknown {sorted(unknown)} (known: {', '.join(makers)})")
    cases = {name: makers[name]() for name in wanted}
    rows = []
    for spin_ns in spins:
        base = chain_us(stream, layers, spin_ns)
        for name, (launch, prefetch, nbytes) in cases.items():
            plain = chain_us(stream, layers, spin_ns, launch) - base
            warmed = chain_us(stream, layers, spin_ns, launch, prefetch) - base
            row = {
                "case": name,
                "spin_us": spin_ns / 1000,
                "stand_in_us": base,
                "bytes": int(nbytes),
                "plain_us": plain,
                "prefetched_us": warmed,
                "speedup": plain / warmed if warmed > 0 else None,
            }
            rows.append(row)
            print(
                f"spin {spin_ns / 1000:4.1f} us (measured {base:6.2f}) {name:20s} {nbytes / 2**20:6.1f} MB: "
                f"plain {plain:7.2f} us ({nbytes / plain / 1e6 if plain > 0 else 0:5.2f} TB/s)  "
                f"prefetched {warmed:7.2f} us  {row['speedup'] or 0:.2f}x",
                flush=True,
            )
            Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
