"""The 8-bit expert kernels alone, before and after the register-only rewrite, against bf16's decode GEMV, on one
MoE layer of random experts at a reference shape, in one run on one GPU:

  decode b=1: moe_q8 by slot (gate/up + down of K experts) new vs old (bench/q8_before.py), and gemv's
              launch_expert_gate_up/down on the same experts in bf16; int8 also on int8 activations (moe_q8_dp4a);
  decode b=16: moe_q8 grouped (--tokens, K each), new vs old; int8 also on int8 activations (moe_q8_dp4a_grouped);
  dequant: dequant_experts of a group of active experts into the bf16 scratch (CUBLAS_PER_EXPERT's pass), new vs old;
  --q8-shapes NAME=W/RG/RD/U/WPS[/L],...: moe_q8's b=1 launch under other launch shapes (warps a block, gate rows a
              warp, down rows a warp, chunks in flight a lane, warps an SM, 1: channel scales read late:
              moe_q8.LaunchShape) beside the
              default's, outputs compared bitwise (a lane's chunks and their order do not depend on the shape).

Per kernel: GPU microseconds per launch (--iters launches captured in one CUDA graph, replayed between two
events; b=1 launches cycle through disjoint expert sets so L2 does not serve them), the bytes it must move (decode:
the routed experts' weights and scales, once; dequant: 8-bit read + bf16 written), GB/s and the fraction of the
HBM roofline (this GPU's streaming read rate, measured at the start of the run by bench/hbm_rate.py;
--hbm-bytes-per-s to override), and the ratios new/old and bf16/new. Outputs of old and new are compared (max
relative difference; they differ only by float32 summation order). int8 experts take per-channel scales, fp8
128x128 block scales (the checkpoints' usual forms). Weights are random bytes (no quantiser pass: a mixtral-shape
layer is 1.4 GB), fp8 bytes with the NaN codes replaced.

    python bench/q8_kernels.py --out out/q8_kernels.json [--shapes mixtral-shape,qwen3moe-shape] [--dtypes int8,fp8]

`--shapes tiny --tokens 2 --iters 1` runs in about a minute under NUMBA_ENABLE_CUDASIM=1 (a smoke run of the script).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import hbm_rate  # noqa: E402

SHAPES = {  # D, F, E, K
    "mixtral-shape": (4096, 14336, 8, 2),
    "qwen3moe-shape": (2048, 768, 128, 8),
    "tiny": (64, 48, 4, 2),
}


def random_layer(rng, code: int, scheme: int, E: int, F: int, D: int):
    """uint8 [E, stride] of random expert blocks (weights random bytes, scales in [0.5, 1.5) / 64) and meta."""
    from expert_service.kernels import expert_quant as q

    offs = q.block_offsets(code, scheme, F, D)
    stride = -(-offs[6] // 4096) * 4096
    blocks = rng.integers(0, 256, (E, stride), dtype=np.uint8)
    if code == q.CODE_FP8:
        blocks[(blocks & 0x7F) == 0x7F] &= 0xF7  # no NaN codes
    for k, (rows, cols) in enumerate(((F, D), (F, D), (D, F))):
        n = int(np.prod(q.scale_shape(scheme, rows, cols)))
        scales = (rng.random((E, n), dtype=np.float32) + 0.5) / 64
        blocks[:, offs[3 + k] : offs[3 + k] + 4 * n] = scales.view(np.uint8)
    meta = np.stack([q.meta_row(code, scheme, offs)] * E)
    return blocks, meta, offs


def timed(fn, iters: int, stream) -> float:
    """Microseconds of GPU time per fn(i): `iters` calls captured in one CUDA graph and replayed between two
    events (bench/kernels.py graph_timed), so Numba's per-launch host cost (tens of microseconds, as large as a
    small layer's kernels) is not counted."""
    from numba import config

    from bench.kernels import graph_timed

    if config.ENABLE_CUDASIM:  # the simulator has no graphs: a smoke run times nothing meaningful anyway
        t0 = time.perf_counter()
        for i in range(iters):
            fn(i)
        return (time.perf_counter() - t0) / iters * 1e6
    return graph_timed(lambda i, _stream: fn(i), stream, iters) * 1e6


def row(name: str, us: float, nbytes: int, hbm_bytes_per_s: float) -> dict:
    """One kernel's entry, printed: time, bytes, GB/s and the fraction of the roofline `hbm_bytes_per_s`."""
    gbs = nbytes / (us * 1e-6) / 1e9
    print(f"  {name:34s} {us:10.1f} us  {nbytes / 1e6:9.1f} MB  {gbs:8.1f} GB/s  {gbs * 1e9 / hbm_bytes_per_s:6.1%}")
    return {"us": us, "bytes": nbytes, "gb_s": gbs, "roofline_fraction": gbs * 1e9 / hbm_bytes_per_s}


def max_rel(a, b) -> float:
    a, b = a.copy_to_host(), b.copy_to_host()
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def shapes_dtypes_q8_shapes(parser: argparse.ArgumentParser, args, known: dict) -> tuple[list, list, dict]:
    """--shapes (names in `known`), --dtypes (int8, fp8) and --q8-shapes, checked: a bad one ends the run with the
    parser's one-line usage error."""
    try:
        q8_shapes = parse_q8_shapes(args.q8_shapes)
    except ValueError as exc:
        parser.error(str(exc))
    shapes, dtypes = args.shapes.split(","), args.dtypes.split(",")
    if any(s not in known for s in shapes) or any(d not in ("int8", "fp8") for d in dtypes):
        parser.error(f"--shapes from {list(known)}, --dtypes from int8, fp8")
    return shapes, dtypes, q8_shapes


def parse_q8_shapes(text: str) -> dict:
    """'NAME=W/RG/RD/U/WPS[/L],...' -> {name: moe_q8.LaunchShape} (L: late_scales, 0 or 1)."""
    from expert_service.kernels.moe_q8 import LaunchShape

    out = {}
    for item in filter(None, text.split(",")):
        name, _, spec = item.partition("=")
        fields = spec.split("/")
        shape_ok = len(fields) in (5, 6) and all(f.isdigit() and int(f) > 0 for f in fields[:5])
        if not name or not shape_ok or (len(fields) == 6 and fields[5] not in ("0", "1")):
            raise ValueError(
                f"--q8-shapes: {item!r} is not NAME=W/RG/RD/U/WPS[/L] (five positive integers, then 0 or 1)"
            )
        out[name] = LaunchShape(*map(int, fields))
    return out


def bench_shape(shape: str, dtypes: list[str], iters: int, T: int, rate: float, q8_shapes: dict | None = None) -> dict:
    """Every kernel of one shape; `rate` is the roofline fractions' denominator (bytes a second)."""
    from numba import cuda

    from bench import q8_before as old
    from expert_service.cuda.moe import dequant_group
    from expert_service.experts.grouping import group_by_expert
    from expert_service.kernels import expert_quant as q
    from expert_service.kernels.dequant_experts import launch_dequant_experts
    from expert_service.kernels.gemv import launch_expert_down, launch_expert_gate_up
    from expert_service.kernels.moe_q8 import launch_q8_down, launch_q8_gate_up
    from expert_service.kernels.moe_q8_dp4a import gate_up_parts, launch_dp4a_down, launch_dp4a_gate_up
    from expert_service.kernels.moe_q8_dp4a_grouped import (
        launch_dp4a_grouped_down,
        launch_dp4a_grouped_gate_up,
        launch_dp4a_quantize_tokens,
    )

    D, F, E, K = SHAPES[shape]
    rng = np.random.default_rng(0)
    stream = cuda.stream()
    out: dict = {}
    # b=1 launches cycle through disjoint expert sets, so a small layer's experts (qwen3: 8 x 4.7 MB in 8 bits)
    # are not served from the 50 MB L2 by the launch before
    perm = rng.permutation(E)
    sets = [cuda.to_device(np.sort(perm[j : j + K]).astype(np.int32).reshape(1, K)) for j in range(0, E - K + 1, K)]
    x = cuda.to_device(rng.standard_normal((1, D)).astype(np.float32))
    h, h_old, h_dp4a = (cuda.device_array((K, F), np.float32) for _ in range(3))
    y, y_old, y_dp4a = (cuda.device_array((K, D), np.float32) for _ in range(3))
    part_max = cuda.device_array((K, gate_up_parts(F)), np.float32)

    bf16 = rng.integers(0, 1 << 16, (E, 3 * F * D), dtype=np.uint16) & np.uint16(0x80FF) | np.uint16(0x3C00)
    dbf16 = cuda.to_device(bf16)
    del bf16
    print(f"{shape}: D={D} F={F} E={E} K={K}")
    b16 = timed(
        lambda i: (
            launch_expert_gate_up(x, sets[i % len(sets)], dbf16, F, D, h, stream=stream),
            launch_expert_down(h, sets[i % len(sets)], dbf16, F, D, y, stream=stream),
        ),
        iters,
        stream,
    )
    out["bf16_gemv_b1"] = row("bf16 gemv, b=1", b16, K * 3 * F * D * 2, rate)

    tids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    groups = group_by_expert(tids, E)
    order, offsets = cuda.to_device(groups.order.astype(np.int32)), cuda.to_device(groups.offsets.astype(np.int32))
    xt = cuda.to_device(rng.standard_normal((T, D)).astype(np.float32))
    ht, ht_old = (cuda.device_array((T * K, F), np.float32) for _ in range(2))
    yt, yt_old, yt_dp4a = (cuda.device_array((T * K, D), np.float32) for _ in range(3))
    ht_dp4a = cuda.device_array((T * K, F), np.float32)
    part_t = cuda.device_array((T * K, gate_up_parts(F)), np.float32)
    xq_t, xs_t = cuda.device_array((T, D), np.uint8), cuda.device_array(T, np.float32)
    active_t = int(np.count_nonzero(np.diff(groups.offsets)))

    for name in dtypes:
        code, scheme = (q.CODE_INT8, q.SCALE_CHANNEL) if name == "int8" else (q.CODE_FP8, q.SCALE_BLOCK)
        blocks, meta, offs = random_layer(rng, code, scheme, E, F, D)
        W, dmeta, kinds = cuda.to_device(blocks), cuda.to_device(meta), q.layer_kinds(meta)
        layout = q.shared_layout(meta)  # what the engine's launches give under CudaOptions.q8_layout_at_launch
        per_expert = offs[6]  # weights and scales, as stored
        del blocks
        res: dict = {}

        def new_b1(i, layout=None):
            launch_q8_gate_up(x, W, dmeta, F, D, h, ids=sets[i % len(sets)], stream=stream, kinds=kinds, layout=layout)
            launch_q8_down(h, W, dmeta, F, D, y, ids=sets[i % len(sets)], stream=stream, kinds=kinds, layout=layout)

        def dp4a_b1(i):
            launch_dp4a_gate_up(x, sets[i % len(sets)], W, dmeta, F, D, h_dp4a, part_max, stream=stream)
            launch_dp4a_down(h_dp4a, part_max, sets[i % len(sets)], W, dmeta, F, D, y_dp4a, stream=stream)

        def old_b1(i):
            old.launch_q8(x, None, None, sets[i % len(sets)], W, dmeta, F, D, K, True, h_old, stream)
            old.launch_q8(h_old, None, None, sets[i % len(sets)], W, dmeta, D, F, 1, False, y_old, stream)

        def new_grouped(_i):
            grouped = dict(offsets=offsets, stream=stream, kinds=kinds)
            launch_q8_gate_up(xt, W, dmeta, F, D, ht, order=order, **grouped)
            launch_q8_down(ht, W, dmeta, F, D, yt, **grouped)

        def dp4a_grouped(_i):
            launch_dp4a_quantize_tokens(xt, xq_t, xs_t, stream=stream)
            launch_dp4a_grouped_gate_up(xq_t, xs_t, order, offsets, K, W, dmeta, F, D, ht_dp4a, part_t, stream=stream)
            launch_dp4a_grouped_down(ht_dp4a, part_t, offsets, W, dmeta, F, D, yt_dp4a, stream=stream)

        def old_grouped(_i):
            old.launch_q8(xt, order, offsets, None, W, dmeta, F, D, K, True, ht_old, stream)
            old.launch_q8(ht_old, None, offsets, None, W, dmeta, D, F, 1, False, yt_old, stream)

        given_b1 = functools.partial(new_b1, layout=layout)  # offsets as launch arguments, no meta read
        res["layout_b1"] = row(f"{name} moe_q8 layout given, b=1", timed(given_b1, iters, stream), K * per_expert, rate)
        res["new_b1"] = row(f"{name} moe_q8 new, b=1", timed(new_b1, iters, stream), K * per_expert, rate)
        res["layout_over_meta_read_b1"] = res["new_b1"]["us"] / res["layout_b1"]["us"]
        want = h.copy_to_host(), y.copy_to_host()  # new_b1's last set
        given_b1(iters - 1)
        res["layout_b1"]["equal"] = bool(
            np.array_equal(h.copy_to_host(), want[0]) and np.array_equal(y.copy_to_host(), want[1])
        )
        new_b1(iters - 1)  # h and y hold the default launch's outputs again (the comparisons below read them)
        if q8_shapes:
            res["launch_shapes"] = launch_shapes(
                q8_shapes, name, x, W, dmeta, kinds, sets, h, y, iters, stream, per_expert, rate
            )
            res["launch_shapes"]["default"] = res["new_b1"]
        if name == "int8":  # the same step on int8 activations (dp4a), against the float32-activation outputs
            res["dp4a_b1"] = row("int8 moe_q8_dp4a, b=1", timed(dp4a_b1, iters, stream), K * per_expert, rate)
            dp4a_b1(iters - 1)  # the set new_b1 ended on (h and y hold its outputs)
            res["dp4a_b1_max_rel_diff"] = max_rel(y_dp4a, y)
        res["old_b1"] = row(f"{name} moe_q8 old, b=1", timed(old_b1, iters, stream), K * per_expert, rate)
        res["b1_max_rel_diff"] = max(max_rel(h, h_old), max_rel(y, y_old))
        tb = active_t * per_expert
        res[f"new_b{T}"] = row(f"{name} moe_q8 new, grouped b={T}", timed(new_grouped, iters, stream), tb, rate)
        if name == "int8":
            res[f"dp4a_b{T}"] = row(f"int8 moe_q8_dp4a_grouped, b={T}", timed(dp4a_grouped, iters, stream), tb, rate)
            res[f"dp4a_b{T}_max_rel_diff"] = max_rel(yt_dp4a, yt)
        res[f"old_b{T}"] = row(f"{name} moe_q8 old, grouped b={T}", timed(old_grouped, iters, stream), tb, rate)
        res[f"b{T}_max_rel_diff"] = max(max_rel(ht, ht_old), max_rel(yt, yt_old))

        group = dequant_group(E, F, D, 2)  # a half of the bf16 scratch, as CUBLAS_PER_EXPERT widens it
        scratch, scratch_old = (cuda.device_array((group, 3 * F * D), np.uint16) for _ in range(2))
        every = cuda.to_device(np.arange(E + 1, dtype=np.int32))  # every expert active
        moved = group * 3 * F * D * 3  # 8-bit read, bf16 written
        res["dequant_new"] = row(
            f"{name} dequant new, {group} experts",
            timed(lambda _i: launch_dequant_experts(W, dmeta, every, 0, F, D, scratch, stream=stream), iters, stream),
            moved,
            rate,
        )
        res["dequant_old"] = row(
            f"{name} dequant old, {group} experts",
            timed(
                lambda _i: old.launch_dequant_experts(W, dmeta, every, 0, F, D, scratch_old, stream=stream),
                iters,
                stream,
            ),
            moved,
            rate,
        )
        res["dequant_equal"] = bool(np.array_equal(scratch.copy_to_host(), scratch_old.copy_to_host()))
        res["ratios"] = {
            "b1_new_over_old": res["old_b1"]["us"] / res["new_b1"]["us"],
            "b1_bf16_gemv_over_new": b16 / res["new_b1"]["us"],
            f"b{T}_new_over_old": res[f"old_b{T}"]["us"] / res[f"new_b{T}"]["us"],
            "dequant_new_over_old": res["dequant_old"]["us"] / res["dequant_new"]["us"],
        }
        if "dp4a_b1" in res:
            res["ratios"]["b1_dp4a_over_new"] = res["new_b1"]["us"] / res["dp4a_b1"]["us"]
            res["ratios"]["b1_bf16_gemv_over_dp4a"] = b16 / res["dp4a_b1"]["us"]
            res["ratios"][f"b{T}_dp4a_over_new"] = res[f"new_b{T}"]["us"] / res[f"dp4a_b{T}"]["us"]
            print(
                f"  int8: dp4a (int8 activations) vs float32 activations, max rel diff b=1 "
                f"{res['dp4a_b1_max_rel_diff']:.1e}, b={T} {res[f'dp4a_b{T}_max_rel_diff']:.1e}"
            )
        print(f"  {name}: " + "  ".join(f"{k} {v:.2f}x" for k, v in res["ratios"].items()))
        print(
            f"  {name}: max rel diff old/new b=1 {res['b1_max_rel_diff']:.1e}, b={T} {res[f'b{T}_max_rel_diff']:.1e}, "
            f"dequant bitwise equal {res['dequant_equal']}"
        )
        out[name] = res
    return out


def launch_shapes(
    shapes: dict,
    name: str,
    x,
    W,
    dmeta,
    kinds,
    sets,
    h,
    y,
    iters: int,
    stream,
    per_expert: int,
    rate: float,
) -> dict:
    """moe_q8's b=1 gate/up + down under each launch shape: time, bytes, and whether h and y equal the default
    shape's bit for bit (h and y hold the default launch's last outputs)."""
    from numba import cuda

    from expert_service.kernels.moe_q8 import launch_q8_down, launch_q8_gate_up

    F, D = h.shape[1], x.shape[1]
    K = sets[0].size
    want_h, want_y = h.copy_to_host(), y.copy_to_host()
    h2, y2 = cuda.device_array_like(h), cuda.device_array_like(y)
    out = {}
    for label, launch_shape in shapes.items():

        def run(i, s=launch_shape):
            ids = sets[i % len(sets)]
            launch_q8_gate_up(x, W, dmeta, F, D, h2, ids=ids, stream=stream, kinds=kinds, shape=s)
            launch_q8_down(h2, W, dmeta, F, D, y2, ids=ids, stream=stream, kinds=kinds, shape=s)

        us = timed(run, iters, stream)
        run(iters - 1)  # the default's last set, so the outputs compare
        stream.synchronize()
        out[label] = row(f"{name} moe_q8 {label} {'/'.join(map(str, launch_shape))}", us, K * per_expert, rate)
        out[label]["shape"] = list(launch_shape)
        out[label]["equal"] = bool(
            np.array_equal(h2.copy_to_host(), want_h) and np.array_equal(y2.copy_to_host(), want_y)
        )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/q8_kernels.json")
    parser.add_argument("--shapes", default="mixtral-shape,qwen3moe-shape")
    parser.add_argument("--dtypes", default="int8,fp8")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=16, help="tokens of the grouped (b > 1) decode step")
    parser.add_argument(
        "--q8-shapes",
        default="",
        help="NAME=W/RG/RD/U/WPS[/L],... moe_q8 b=1 launch shapes to compare (L=1: late scales)",
    )
    hbm_rate.add_argument(parser)
    args = parser.parse_args(argv)
    shapes, dtypes, q8_shapes = shapes_dtypes_q8_shapes(parser, args, SHAPES)
    roofline = hbm_rate.roofline(args.hbm_bytes_per_s)
    print(roofline.summary(), flush=True)
    result = {
        **roofline.record(),
        "shapes": {s: bench_shape(s, dtypes, args.iters, args.tokens, roofline.bytes_per_s, q8_shapes) for s in shapes},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
