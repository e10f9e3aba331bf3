"""A layer's attention projections alone, 8-bit against bf16, in one run on one GPU: what the engine launches for
q|k|v and o_proj at a step of R rows.

  bf16:  R = 1: gemv over the stacked q|k|v rows, gemv adding o into the residual (the engine's fused GEMV path);
         R > 1: the rows cast to bf16 once, three cuBLAS GEMMs for q, k, v, a cast and one adding GEMM for o.
  8-bit: cuda/attention_8bit.py as the engine runs it with the default CudaOptions: linear_q8 up to 4 rows
         (q|k|v one launch at R = 1, o adding in its epilogue), past them the row table, a bf16 copy of the rows
         and moe_gemm_q8mma per matrix, split-K where a matrix has too few output tiles, and from
         attention_8bit_dense_rows rows each matrix widened into a bf16 scratch for cuBLAS; beside it "-widened"
         (widened at every row count), "-gemm" (the 8-bit GEMM where the engine widens), "-whole" (the GEMM never
         split) and "-stream" (linear_q8 at every row count, one pass over the weights a tile of 4 rows) up to 64
         rows, and at up to 4 rows "-meta-read" (each launch reading its meta row on the device instead of
         taking the block offsets as launch arguments: CudaOptions.q8_layout_at_launch off) and each --q8-shapes
         NAME=W/RG/RD/U/WPS[/L] launch shape of the weight stream (moe_q8.LaunchShape).

Per row count: GPU microseconds per layer (the launches of --copies layers of distinct random weights captured in
one CUDA graph and replayed between two events, so L2 holds none of the next layer's weights and Numba's host cost
is not counted), the weight bytes it must read (8-bit: codes and scales), the fraction of the HBM roofline (this
GPU's streaming read rate, bench/hbm_rate.py, measured at the start) and bf16 / 8-bit. Outputs are compared with
the bf16 path's on the same dequantised weights (max relative difference of o's residual: the 8-bit rows' error).

    python bench/attention_8bit.py --out out/attention_8bit.json [--shapes mixtral,qwen3] [--dtypes int8,fp8] \
        [--q8-shapes rd2=4/2/2/2/16]

`--shapes tiny --rows 1,6 --copies 2` runs in seconds under NUMBA_ENABLE_CUDASIM=1 (a smoke run of the script).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import hbm_rate  # noqa: E402
from bench.q8_kernels import shapes_dtypes_q8_shapes, timed  # noqa: E402

SHAPES = {  # hidden D, q width, kv width
    "mixtral": (4096, 4096, 1024),
    "qwen3": (2048, 4096, 512),
    "tiny": (64, 64, 32),
}
ROWS = (1, 4, 16, 64, 512)
LAYER_BYTES = 256 << 20  # weights a graph's launches cycle through: several times the 50-60 MB L2


def random_layer(rng, code: int, D: int, Q: int, KV: int):
    """(bf16 qkv [Q+2KV, D], bf16 o [D, Q] as uint16; the format's qkv and o blocks as uint8; their dequantised
    float32 matrices) of random weights around +-0.02."""
    import ml_dtypes

    from expert_service.kernels import expert_quant as q

    def block(w):
        raw, scale = q.quantize(w, code, q.SCALE_CHANNEL)
        at = -(-raw.size // 64) * 64
        out = np.zeros(at + scale.nbytes, np.uint8)
        out[: raw.size], out[at:] = raw.reshape(-1), scale.view(np.uint8)
        deq = q.decode(raw.reshape(-1), code).reshape(w.shape).astype(np.float32) * scale[:, None]
        return out, deq

    w_qkv = (rng.standard_normal((Q + 2 * KV, D)) * 0.02).astype(np.float32)
    w_o = (rng.standard_normal((D, Q)) * 0.02).astype(np.float32)
    (qkv8, qkv_deq), (o8, o_deq) = block(w_qkv), block(w_o)
    bf16 = lambda w: w.astype(ml_dtypes.bfloat16).view(np.uint16)  # noqa: E731  (the dequantised values)
    return bf16(qkv_deq), bf16(o_deq), qkv8, o8


def eight_bit_layer(qkv8, o8, code: int, D: int, Q: int, KV: int, stream):
    """Projections8Bit of one layer from its two blocks, uploaded, as DeviceWeights makes them."""
    from numba import cuda

    from expert_service.cuda.weights import layer_projections, projection_metas

    metas = projection_metas(code, qkv8.size - 4 * (Q + 2 * KV), o8.size - 4 * D, D, Q, KV)
    upload = functools.partial(cuda.to_device, stream=stream)
    return layer_projections(upload(qkv8), upload(o8), upload(metas), metas, code, D, Q, KV)


def variants(eight, R: int, widest: int, q8_shapes: dict, stream) -> dict:
    """label suffix -> the DeviceAttention8Bit to time at R rows: the engine's, and the alternatives that apply."""
    import copy

    from expert_service.cuda.linear_8bit import MMA_MIN_ROWS, EightBitRows

    def with_rows(rows):
        other = copy.copy(eight)
        other.rows = rows
        return other

    out = {"": eight}
    ours, first = eight.rows, eight.layers[0]
    if ours.linear is not None:  # cuBLAS: the widened matrices at every row count, the 8-bit GEMM where they widen
        widen = eight.scratch_elements(first.q.n_in, first.q.n_out)
        dtype = ours.linear.weights_dtype
        widened = EightBitRows(
            ours.max_rows, widest, True, stream, widen_elements=widen, dense_dtype=dtype, linear=ours.linear
        )
        widened.use_dense_rows(1)
        out["-widened"] = with_rows(widened)
        if ours.dense_at(R):
            out["-gemm"] = with_rows(EightBitRows(ours.max_rows, widest, True, stream, split_outputs=widest))
    if R >= MMA_MIN_ROWS:
        out["-whole"] = with_rows(EightBitRows(eight.rows.max_rows, widest, True, stream))
        if R <= 64:
            out["-stream"] = with_rows(EightBitRows(eight.rows.max_rows, widest, False, stream))
    else:
        read = EightBitRows(eight.rows.max_rows, widest, True, stream)
        read.layout_at_launch = False  # each launch reads its meta row (CudaOptions.q8_layout_at_launch off)
        out["-meta-read"] = with_rows(read)
        for label, shape in q8_shapes.items():
            out[f"-{label}"] = with_rows(EightBitRows(eight.rows.max_rows, widest, True, stream, stream_shape=shape))
    return out


def bench_shape(
    name: str, dtypes: list[str], rows: list[int], copies: int | None, rate: float, q8_shapes: dict
) -> dict:
    from numba import cuda

    from expert_service.cuda.attention_8bit import DeviceAttention8Bit
    from expert_service.cuda.cublas import WORKSPACE_BYTES, Cublas
    from expert_service.cuda.linear import DeviceLinear
    from expert_service.engine.cuda_options import CudaOptions
    from expert_service.kernels import expert_quant as q
    from expert_service.kernels.numeric import SIMULATOR

    D, Q, KV = SHAPES[name]
    n = Q + 2 * KV
    layer_bf16 = 2 * (n * D + D * Q)
    copies = copies or max(2, -(-LAYER_BYTES // layer_bf16))
    stream, R_max = cuda.stream(), max(rows)
    # the simulator has no cuBLAS: a smoke run times the bf16 side at one row only
    cublas = None if SIMULATOR else Cublas(stream, cuda.device_array(WORKSPACE_BYTES, np.uint8, stream=stream))
    workspace = SimpleNamespace(cast=cuda.device_array(R_max * max(D, Q), np.uint16, stream=stream))
    linear = DeviceLinear(stream, cublas, workspace, np.dtype(np.uint16))
    no_bias = SimpleNamespace(layer=lambda i, name: None, dtype=np.dtype(np.uint16))
    rng = np.random.default_rng(0)
    out: dict = {"D": D, "q": Q, "kv": KV, "copies": copies, "rows": {}}
    for dtype in dtypes:
        code = q.CODES["int8" if dtype == "int8" else "float8_e4m3fn"]
        layers = [random_layer(rng, code, D, Q, KV) for _ in range(copies)]
        bf16 = [(cuda.to_device(a, stream=stream), cuda.to_device(b, stream=stream)) for a, b, _, _ in layers]
        eight = DeviceAttention8Bit(
            tuple(eight_bit_layer(c, d, code, D, Q, KV, stream) for _, _, c, d in layers),
            no_bias,
            R_max,
            stream,
            linear if cublas is not None else None,
            CudaOptions().attention_8bit_dense_rows,  # the shipped threshold of widening
        )
        eight.rows.layout_at_launch = CudaOptions().q8_layout_at_launch  # as CudaModel sets it
        nbytes8 = layers[0][2].size + layers[0][3].size
        for R in rows:
            x = cuda.to_device(rng.standard_normal((R, D)).astype(np.float32), stream=stream)
            attn = cuda.to_device(rng.standard_normal((R, Q)).astype(np.float32), stream=stream)
            h0 = rng.standard_normal((R, D)).astype(np.float32)
            h_bf16, h_8bit = cuda.to_device(h0, stream=stream), cuda.to_device(h0, stream=stream)

            def qkv_buffer():
                """q [R, Q], k and v [R, KV] back to back, as the workspace's qkv (one row [q | k | v] at R = 1)."""
                flat = cuda.device_array(R * n, np.float32, stream=stream)
                views = (flat[: R * Q].reshape(R, Q), flat[R * Q : R * (Q + KV)].reshape(R, KV))
                return flat, views + (flat[R * (Q + KV) :].reshape(R, KV),), flat.reshape(1, n) if R == 1 else None

            (flat_bf16, views, stacked), (flat_8bit, views_8bit, stacked_8bit) = qkv_buffer(), qkv_buffer()
            parts = ((0, Q), (Q, Q + KV), (Q + KV, n))

            def run_bf16(i, h=h_bf16, x=x, attn=attn, views=views, stacked=stacked):
                w_qkv, w_o = bf16[i % copies]
                if stacked is not None:
                    linear.linear(x, w_qkv, stacked)
                else:
                    xc = linear.as_weight_dtype(x)
                    for (lo, hi), view in zip(parts, views):  # the engine's three GEMMs
                        linear.linear(x, w_qkv[lo:hi], view, xc=xc)
                linear.linear(attn, w_o, h, accumulate=True)

            def run_8bit(i, h=h_8bit, x=x, attn=attn, views=views_8bit, stacked=stacked_8bit, att=eight):
                att.qkv(i % copies, x, *views, stacked, fused=True)  # the pass's row table: written before
                att.o(i % copies, attn, h)

            def timed_8bit(att, R=R):
                att.start_pass(R)  # once a forward pass in the engine, for every layer
                return timed(functools.partial(run_8bit, att=att), copies * 4, stream)

            if cublas is None and R > 1:
                run_bf16 = None  # type: ignore[assignment]
            us = {"bf16": timed(run_bf16, copies * 4, stream)} if run_bf16 else {}
            for suffix, att in variants(eight, R, max(D, Q), q8_shapes, stream).items():
                us[dtype + suffix] = timed_8bit(att)
            entry = {}
            for label, t in us.items():
                nbytes = layer_bf16 if label == "bf16" else nbytes8  # every 8-bit variant reads the same bytes
                entry |= {
                    f"{label}_us": t,
                    f"{label}_bytes": nbytes,
                    f"{label}_roofline_fraction": nbytes / rate / t * 1e6,
                }
            line = "  ".join(f"{k} {t:8.1f} us ({entry[f'{k}_roofline_fraction']:6.1%})" for k, t in us.items())
            if run_bf16 is not None:  # q|k|v and the residual after o on each side (first copy's weights)
                h_bf16.copy_to_device(h0, stream=stream)
                h_8bit.copy_to_device(h0, stream=stream)
                eight.start_pass(R)
                run_bf16(0)
                run_8bit(0)
                stream.synchronize()
                update = float(np.abs(h_bf16.copy_to_host() - h0).max())
                diff = float(np.abs(h_8bit.copy_to_host() - h_bf16.copy_to_host()).max()) / max(update, 1e-30)
                want = flat_bf16.copy_to_host()
                qkv_diff = float(np.abs(flat_8bit.copy_to_host() - want).max() / max(np.abs(want).max(), 1e-30))
                entry |= {f"bf16_over_{dtype}": us["bf16"] / us[dtype], "o_diff_over_largest_update": diff}
                entry["qkv_diff_over_largest"] = qkv_diff
                line += f"  x{us['bf16'] / us[dtype]:5.2f}  qkv diff {qkv_diff:.3g}  o diff {diff:.3g}"
            out["rows"].setdefault(str(R), {}).update(entry)
            print(f"  {name:8s} {dtype:5s} R={R:4d}  {line}", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/attention_8bit.json")
    parser.add_argument("--shapes", default="mixtral,qwen3")
    parser.add_argument("--dtypes", default="int8,fp8")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--copies", type=int, default=None, help="layers of weights a graph cycles through")
    parser.add_argument(
        "--q8-shapes",
        default="",
        help="NAME=W/RG/RD/U/WPS[/L],... weight-stream launch shapes to compare (L=1: late scales)",
    )
    hbm_rate.add_argument(parser)
    args = parser.parse_args(argv)
    shapes, dtypes, q8_shapes = shapes_dtypes_q8_shapes(parser, args, SHAPES)
    rows = [int(r) for r in args.rows.split(",")]
    roofline = hbm_rate.roofline(args.hbm_bytes_per_s)
    print(roofline.summary(), flush=True)
    result = {
        **roofline.record(),
        "shapes": {s: bench_shape(s, dtypes, rows, args.copies, roofline.bytes_per_s, q8_shapes) for s in shapes},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
