"""A dense linear layer on 8-bit rows: out [R, N] (+)= x [R, K] @ (q * scale)^T, q int8 or fp8 e4m3 [N, K] with one
float32 scale per output row (the 8-bit LM head and attention projections). Reference: ``linear_q8_reference``.

The matrix is the down projection of a one-expert layer to moe_q8's kernels (the same HBM-streaming bodies that
run 8-bit experts, dequantising in registers): its block is the matrix followed by its scales, `meta` row 0 says
where the scales start. One row (decode at batch 1) goes by slot, every weight byte read once; more rows are
the expert's grouped positions [0, R), TOK_TILE rows per pass over a warp's weight rows (the passes after the
first find those rows in L2). No host reads: graph-capturable.
"""

from __future__ import annotations

import numpy as np

from expert_service.kernels import expert_quant
from expert_service.kernels.moe_q8 import DECODE_SHAPE, LaunchShape, _launch
from expert_service.kernels.numeric import check_array

# the 8-bit encodings a matrix may have: per-row scales only (a block scale would split the K axis, which this
# layout does not record)
CODES = (expert_quant.CODE_INT8, expert_quant.CODE_FP8)


def matrix_meta(code: int, scale_offset: int, offset: int = 0) -> np.ndarray:
    """meta [1, META_WIDTH] int32 for a block holding the matrix from byte `offset` (a multiple of 16: whole
    16-byte loads) and its per-row float32 scales from byte `scale_offset` (a multiple of 4: the kernel indexes the
    block's bytes as floats there). A nonzero offset picks rows of a stacked matrix (q|k|v's k rows: their codes
    and their scales further on)."""
    _check_code(code)
    if offset < 0 or offset % 16:
        raise ValueError(f"matrix offset {offset}: a matrix starts at a multiple of 16 bytes")
    if scale_offset <= offset or scale_offset % 4:
        raise ValueError(f"scale offset {scale_offset}: the scales start past the matrix, at a multiple of 4 bytes")
    return np.array([[code, expert_quant.SCALE_CHANNEL, 0, 0, offset, 0, 0, scale_offset]], np.int32)


def row_bounds(max_rows: int):
    """int32 [max_rows + 1, 2], row r = [0, r]: the offsets a grouped launch of r rows reads (a fixed device
    address per row count, so a captured graph replays it)."""
    bounds = np.zeros((max_rows + 1, 2), np.int32)
    bounds[:, 1] = np.arange(max_rows + 1)
    return bounds


def launch_linear_q8(
    x, block, meta, code: int, n_out: int, out, bounds, stream=0, accumulate: bool = False,
    shape: LaunchShape = DECODE_SHAPE, layout=None,
) -> None:
    """x [R, K] float32; block uint8 [nbytes] (matrix [n_out, K] of `code` from byte meta[0, 4], its scales [n_out]
    float32 from byte meta[0, 7]; 16-byte aligned, nbytes a multiple of 4); meta [1, META_WIDTH] int32 (device,
    matrix_meta); out [R, n_out] float32, written (accumulate: added to); bounds: row_bounds(>= R) on the device.
    K must be a positive multiple of 16 (whole 16-byte chunks of a row). shape: how the rows spread over warps and
    blocks (moe_q8.LaunchShape). layout: meta's row on the host (the same values), so the offsets go in as launch
    arguments and the weights stream without waiting on a meta read; None: the kernel reads meta."""
    R, K = x.shape
    check_array("x", x, (R, K), np.float32)
    check_array("out", out, (R, n_out), np.float32)
    check_array("meta", meta, (1, expert_quant.META_WIDTH), np.int32)
    check_array("bounds", bounds, (bounds.shape[0], 2), np.int32)
    _check_code(code)
    if K % 16 or K <= 0 or n_out <= 0:
        raise ValueError(f"an 8-bit matrix [{n_out}, {K}] needs rows of a positive multiple of 16 values")
    if block.ndim != 1 or np.dtype(block.dtype) != np.uint8 or block.size % 4:
        raise ValueError(f"block must be uint8 [n] with n % 4 == 0, got {block.dtype} {list(block.shape)}")
    if not 1 <= R < bounds.shape[0]:
        raise ValueError(f"{R} rows: bounds hold offsets for 1 to {bounds.shape[0] - 1} rows")
    # one row: one slot running the block directly; more: the expert's grouped positions [0, R)
    offsets = None if R == 1 else bounds[R]
    kinds = ((int(code), expert_quant.SCALE_CHANNEL),)
    experts = block.reshape(1, block.size)  # the one expert's block
    _launch(
        x, None, offsets, None, experts, meta, n_out, K, 1, False, out, stream, None, kinds, shape, accumulate,
        layout=layout, direct=R == 1,
    )


def _check_code(code: int) -> None:
    if code not in CODES:
        raise ValueError(f"dtype code {code}: an 8-bit matrix is int8 ({CODES[0]}) or fp8 e4m3 ({CODES[1]})")


def linear_q8_reference(x: np.ndarray, q: np.ndarray, scale: np.ndarray, code: int) -> np.ndarray:
    """float64 x @ (q * scale)^T with q's codes decoded exactly (expert_quant.decode)."""
    w = expert_quant.decode(np.ascontiguousarray(q).view(np.uint8), code).astype(np.float64)
    return x.astype(np.float64) @ (w * scale.astype(np.float64)[:, None]).T
