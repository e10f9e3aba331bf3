"""8-bit dense matrices on the device (the LM head, the attention projections): out [R, N] (+)= x [R, K] @
(q * scale)^T for the R rows of a step, q int8 or fp8 e4m3 with one float32 scale per output row.

Up to TOK_TILE rows a matrix is a weight stream (linear_q8: moe_q8's bodies, every byte read once in one pass).
More rows would re-stream the weights once per tile of TOK_TILE rows, so they go through the grouped tensor-core
GEMM of 8-bit experts instead (moe_gemm_q8mma, the matrix as the down projection of a one-expert layer): the rows
rounded to bf16 as cuBLAS takes a bf16 matrix's, the codes widened exactly in shared memory, the per-row scale
applied to each fp32 sum. Its row table is written on the device once a step (row_tiles), so a captured step
replays with no allocation and no host read. Either path can add into `out` (a projection that ends in the
residual) in its epilogue: no separate add launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from numba import cuda

from expert_service.kernels.linear_q8 import launch_linear_q8, row_bounds
from expert_service.kernels.moe_align import launch_moe_gather_bf16
from expert_service.kernels.moe_gemm_q8mma import choose_config, launch_q8mma_down
from expert_service.kernels.moe_q8 import TOK_TILE
from expert_service.kernels.row_tiles import launch_row_tiles

if TYPE_CHECKING:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

MMA_MIN_ROWS = TOK_TILE + 1  # fewer rows: one pass of the weight stream


@dataclass(frozen=True)
class Matrix8Bit:
    """One 8-bit matrix [n_out, n_in] on the device: `block` the uint8 range holding it (codes from the meta row's
    matrix offset, per-row float32 scales from its scale offset: linear_q8.matrix_meta), `meta` that row on the
    device, `code` its expert_quant dtype code. Several matrices may share a block (q, k and v of one stacked
    q|k|v block, each with its own offsets)."""

    block: DeviceNDArray
    meta: DeviceNDArray
    code: int
    n_out: int
    n_in: int

    @property
    def takes_mma(self) -> bool:
        return takes_mma(self.n_out, self.block.size)


def takes_mma(n_out: int, block_nbytes: int) -> bool:
    """Whether a matrix of n_out rows in a block of block_nbytes can take the tensor-core GEMM: its output tiles
    are whole 16-column groups of a block of whole 16-byte chunks."""
    return n_out % 16 == 0 and block_nbytes % 16 == 0


def mma_width(max_rows: int) -> int:
    """The most rows a GEMM of 1 to max_rows rows reads: its row count rounded up to its tile's rows."""
    configs = {choose_config(r, 1).block_m: r for r in range(MMA_MIN_ROWS, max_rows + 1)}  # each tile's largest r
    return max((-(-r // bm) * bm for bm, r in configs.items()), default=0)


class StepRows(NamedTuple):
    """A step's input rows for the matrices that read them: x [R, K] float32, and its rows in bf16 in the GEMM's
    order (None below MMA_MIN_ROWS rows)."""

    x: DeviceNDArray
    xs: DeviceNDArray | None


class EightBitRows:
    """Runs 8-bit matrices over 1 to max_rows rows of input width up to widest_input. mma: every matrix it runs
    takes the tensor-core GEMM past TOK_TILE rows; otherwise each takes the weight stream at every row count."""

    def __init__(self, max_rows: int, widest_input: int, mma: bool, stream):
        self.max_rows, self.mma, self.stream = max_rows, mma and max_rows >= MMA_MIN_ROWS, stream
        self.rows = 0
        self.bounds = cuda.to_device(row_bounds(max_rows), stream=stream)
        self.first_row = cuda.to_device(np.zeros((1, 1), np.int32), stream=stream)
        if not self.mma:
            return
        width = mma_width(max_rows)
        self.sorted_ids = cuda.device_array(width, np.int32, stream=stream)
        self.num_tiles = cuda.device_array(1, np.int32, stream=stream)
        self.tile_expert = cuda.to_device(np.zeros(-(-width // 16), np.int32), stream=stream)  # one expert: 0
        self.rows_bf16 = cuda.device_array(width * widest_input, np.uint16, stream=stream)

    @staticmethod
    def planned_nbytes(max_rows: int, widest_input: int, mma: bool) -> int:
        """The device bytes __init__ allocates, from the sizes alone (the device-memory plan counts them)."""
        nbytes = (max_rows + 1) * 2 * 4 + 4  # bounds, first_row
        if mma and max_rows >= MMA_MIN_ROWS:
            width = mma_width(max_rows)
            nbytes += width * 4 + 4 + -(-width // 16) * 4 + width * widest_input * 2
        return nbytes

    @property
    def on_mma(self) -> bool:
        return self.mma and self.rows >= MMA_MIN_ROWS

    def set_rows(self, rows: int) -> None:
        """The row count of the launches that follow; past TOK_TILE rows this writes the GEMM's row table (one
        launch, shared by every matrix of the step)."""
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"{rows} rows: laid out for 1 to {self.max_rows}")
        self.rows = rows
        if self.on_mma:
            self.config = choose_config(rows, 1)
            self.tiles = -(-rows // self.config.block_m)
            bm = self.config.block_m
            launch_row_tiles(rows, bm, self.sorted_ids[: self.tiles * bm], self.num_tiles, stream=self.stream)

    def inputs(self, x) -> StepRows:
        """x [R, K] float32 (R the set row count) as the matrices read it: on the GEMM, rounded to bf16 once for
        every matrix of that input."""
        R, K = x.shape
        if R != self.rows:
            raise ValueError(f"x has {R} rows, set_rows said {self.rows}")
        if not self.on_mma:
            return StepRows(x, None)
        n = self.tiles * self.config.block_m
        xs = self.rows_bf16[: n * K].reshape(n, K)
        launch_moe_gather_bf16(x, self.sorted_ids[:n], self.num_tiles, 1, self.config.block_m, xs, stream=self.stream)
        return StepRows(x, xs)

    def apply(self, matrix: Matrix8Bit, rows: StepRows, out, accumulate: bool = False) -> None:
        """out [R, n_out] float32 = (accumulate: +=) rows @ matrix^T, every element written."""
        st = self.stream
        if rows.xs is None:
            args = (matrix.code, matrix.n_out, out, self.bounds, self.first_row, st, accumulate)
            launch_linear_q8(rows.x, matrix.block, matrix.meta, *args)
            return
        bm = self.config.block_m
        launch_q8mma_down(
            rows.xs,
            self.tile_expert[: self.tiles],
            self.num_tiles,
            self.sorted_ids[: self.tiles * bm],
            matrix.block.reshape(1, matrix.block.size),
            matrix.meta,
            matrix.n_in,
            matrix.n_out,
            out,
            self.config,
            stream=st,
            accumulate=accumulate,
        )
