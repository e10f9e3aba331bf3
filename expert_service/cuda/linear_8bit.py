"""8-bit dense matrices on the device (the LM head, the attention projections): out [R, N] (+)= x [R, K] @
(q * scale)^T for the R rows of a step, q int8 or fp8 e4m3 with one float32 scale per output row.

Up to TOK_TILE rows a matrix is a weight stream (linear_q8: moe_q8's bodies, every byte read once in one pass).
More rows would re-stream the weights once per tile of TOK_TILE rows, so they go through the grouped tensor-core
GEMM of 8-bit experts instead (moe_gemm_q8mma, the matrix as the down projection of a one-expert layer): the rows
rounded to bf16 as cuBLAS takes a bf16 matrix's, the codes widened exactly in shared memory, the per-row scale
applied to each fp32 sum. Its row table is written on the device once a step (row_tiles), so a captured step
replays with no allocation and no host read. Either path can add into `out` (a projection that ends in the
residual) in its epilogue: no separate add launch.

A matrix of a few thousand rows over a few rows of input is too few output tiles to keep HBM busy (mixtral's o_proj
over 16 rows: 32 tiles for 132 SMs, 8 % of the roofline), so given room for them (`split_outputs`), the GEMM splits
its input axis until the step has about two tiles an SM, each split's sums in a plane of `partials` that split_sum
then adds in a fixed order.

Dense shapes of many rows run that GEMM at a fraction of cuBLAS's speed, so given a dense scratch (`widen_elements`)
and a DeviceLinear, steps of at least `dense_min_rows` rows widen each matrix into the scratch (dequant_matrix:
q * scale rounded to the dense dtype, as the per-expert cuBLAS path widens 8-bit experts) and hand it to cuBLAS
with the rows cast once to that dtype: one extra pass over the matrix (1 byte read, 2 written a weight) in place of
one read of it a tile of rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from numba import cuda

from expert_service.kernels.dequant_matrix import MatrixWidening
from expert_service.kernels.linear_q8 import launch_linear_q8, row_bounds
from expert_service.kernels.moe_align import launch_moe_gather_bf16
from expert_service.kernels.moe_gemm_q8mma import choose_config, launch_q8mma_down, split_plan
from expert_service.kernels.moe_q8 import DECODE_SHAPE, TOK_TILE, LaunchShape
from expert_service.kernels.numeric import SIMULATOR
from expert_service.kernels.row_tiles import launch_row_tiles

if TYPE_CHECKING:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

MMA_MIN_ROWS = TOK_TILE + 1  # fewer rows: one pass of the weight stream
MAX_SPLITS = 8  # split-K parts at most (each a plane of partial sums, and fewer K steps a tile)
SPLIT_PLANES = 4  # the partials hold this many planes of the largest split step (more of smaller ones)
SPLIT_MAX_ROWS = 256  # steps of more rows have tiles enough: no split


@dataclass(frozen=True)
class Matrix8Bit:
    """One 8-bit matrix [n_out, n_in] on the device: `block` the uint8 range holding it (codes from the meta row's
    matrix offset, per-row float32 scales from its scale offset: linear_q8.matrix_meta), `meta` that row on the
    device, `code` its expert_quant dtype code. Several matrices may share a block (q, k and v of one stacked
    q|k|v block, each with its own offsets). host_meta: the same row on the host, so launches take its offsets as
    arguments instead of reading them first (None: the kernel reads meta)."""

    block: DeviceNDArray
    meta: DeviceNDArray
    code: int
    n_out: int
    n_in: int
    host_meta: tuple[int, ...] | None = None

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
    """A step's input rows for the matrices that read them: x [R, K] float32, its rows in bf16 in the GEMM's
    order (on the GEMM, else None), and x in the dense dtype for cuBLAS (on widened matrices, else None)."""

    x: DeviceNDArray
    xs: DeviceNDArray | None
    xc: DeviceNDArray | None = None


def split_capacity(max_rows: int, split_outputs: int) -> int:
    """float32 elements of the split-K partials for steps of up to max_rows rows and outputs split_outputs wide."""
    return SPLIT_PLANES * min(max_rows, SPLIT_MAX_ROWS) * split_outputs if max_rows >= MMA_MIN_ROWS else 0


def split_count(tiles: int, k_dim: int, rows: int, n_out: int, capacity: int, target_tiles: int, cfg) -> int:
    """Parts of the input axis a GEMM of `tiles` output tiles splits into: enough for target_tiles, at most
    MAX_SPLITS, each plane of rows x n_out fitting the partials' capacity (1: no split)."""
    if rows > SPLIT_MAX_ROWS or tiles >= target_tiles:
        return 1
    wanted = min(MAX_SPLITS, -(-target_tiles // tiles), capacity // max(1, rows * n_out))
    return split_plan(wanted, k_dim, cfg)[0] if wanted > 1 else 1


class EightBitRows:
    """Runs 8-bit matrices over 1 to max_rows rows of input width up to widest_input. mma: every matrix it runs
    takes the tensor-core GEMM past TOK_TILE rows; otherwise each takes the weight stream at every row count.
    split_outputs: the widest output a split-K GEMM may write (0: none splits; the LM head has tiles enough).
    stream_shape: the weight stream's launch shape (bench/attention_8bit.py --q8-shapes compares others).
    widen_elements, dense_dtype: a scratch for the largest matrix widened to the dense dtype (0: none); with a
    `linear` (DeviceLinear), steps of at least `dense_min_rows` rows (0: never) run the widened matrices on it."""

    def __init__(
        self,
        max_rows: int,
        widest_input: int,
        mma: bool,
        stream,
        split_outputs: int = 0,
        stream_shape: LaunchShape = DECODE_SHAPE,
        widen_elements: int = 0,
        dense_dtype=np.uint16,
        linear=None,
    ):
        self.max_rows, self.mma, self.stream = max_rows, mma and max_rows >= MMA_MIN_ROWS, stream
        self.stream_shape, self.linear = stream_shape, linear
        self.layout_at_launch = False  # CudaOptions.q8_layout_at_launch (CudaModel sets it)
        self.rows = self.dense_min_rows = 0
        self.partials: DeviceNDArray | None = None  # split-K partial sums (none: no split)
        self.bounds = cuda.to_device(row_bounds(max_rows), stream=stream)
        self.widened: DeviceNDArray | None = None  # the dense scratch
        if linear is not None and np.dtype(linear.weights_dtype) != np.dtype(dense_dtype):
            raise ValueError(f"dense_dtype {np.dtype(dense_dtype)}: cuBLAS here takes {np.dtype(linear.weights_dtype)}")
        self._dense = False  # the set row count's path: widened
        if widen_elements:
            self.widened = cuda.device_array(widen_elements, dense_dtype, stream=stream)
        self._widened_views: dict[tuple[int, int], DeviceNDArray] = {}  # made once a shape: views cost host time
        self._widenings: dict[int, tuple[Matrix8Bit, MatrixWidening]] = {}  # by id, the matrix kept: ids stay unique
        if not self.mma:
            return
        width = mma_width(max_rows)
        self.sorted_ids = cuda.device_array(width, np.int32, stream=stream)
        self.num_tiles = cuda.device_array(1, np.int32, stream=stream)
        self.tile_expert = cuda.to_device(np.zeros(-(-width // 16), np.int32), stream=stream)  # one expert: 0
        self.rows_bf16 = cuda.device_array(width * widest_input, np.uint16, stream=stream)
        if capacity := split_capacity(max_rows, split_outputs):
            self.partials = cuda.device_array(capacity, np.float32, stream=stream)
            # about two tiles an SM (the simulator: a few, so its small shapes split too)
            self.target_tiles = 4 if SIMULATOR else 2 * cuda.get_current_device().MULTIPROCESSOR_COUNT

    @staticmethod
    def planned_nbytes(
        max_rows: int, widest_input: int, mma: bool, split_outputs: int = 0, widen_bytes: int = 0
    ) -> int:
        """The device bytes __init__ allocates, from the sizes alone (the device-memory plan counts them);
        widen_bytes: the dense scratch's (widen_elements x the dense dtype's size)."""
        nbytes = (max_rows + 1) * 2 * 4 + widen_bytes  # bounds, the scratch
        if mma and max_rows >= MMA_MIN_ROWS:
            width = mma_width(max_rows)
            nbytes += width * 4 + 4 + -(-width // 16) * 4 + width * widest_input * 2
            nbytes += split_capacity(max_rows, split_outputs) * 4
        return nbytes

    @property
    def nbytes(self) -> int:
        """The device bytes it holds (planned_nbytes of its sizes)."""
        return sum(a.nbytes for a in vars(self).values() if hasattr(a, "copy_to_host"))

    def variant(self, rows: int, matrices) -> tuple:
        """What decides the kernels a step of `rows` rows over `matrices` launches (the weight stream by slot or
        grouped; the GEMM's tile config and, per matrix, whether it splits; widened for cuBLAS): steps of equal
        variants compile nothing new."""
        if self.dense_at(rows):
            return ("dense",)
        if not (self.mma and rows >= MMA_MIN_ROWS):
            return ("stream", rows == 1)
        cfg = choose_config(rows, 1)
        return cfg, tuple(self._splits(rows, m, cfg) > 1 for m in matrices)

    def _splits(self, rows: int, matrix: Matrix8Bit, cfg) -> int:
        """The split-K parts of the GEMM of `matrix` over `rows` rows in tiles of `cfg` (1: none)."""
        if self.partials is None:
            return 1
        tiles = -(-rows // cfg.block_m) * -(-matrix.n_out // cfg.block_n)
        args = (matrix.n_in, rows, matrix.n_out, self.partials.size, self.target_tiles, cfg)
        return split_count(tiles, *args)

    def warmup_rows(self, counts, matrices) -> tuple[int, ...]:
        """The smallest of `counts` (the row counts steps can have) of each variant: running those loads every
        kernel the others launch."""
        first: dict[tuple, int] = {}
        for rows in sorted(counts):
            first.setdefault(self.variant(rows, matrices), rows)
        return tuple(sorted(first.values()))

    def use_dense_rows(self, min_rows: int) -> None:
        """Steps of at least min_rows rows run widened matrices on cuBLAS from the next set_rows on (0: never; without
        a scratch and a DeviceLinear, never whatever min_rows)."""
        if min_rows < 0:
            raise ValueError(f"dense_min_rows {min_rows}: 0 (never) or a row count")
        self.dense_min_rows = min_rows

    def dense_at(self, rows: int) -> bool:
        """Whether a step of `rows` rows runs widened matrices on cuBLAS."""
        usable = self.widened is not None and self.linear is not None
        return usable and 0 < self.dense_min_rows <= rows

    @property
    def on_dense(self) -> bool:
        return self._dense

    @property
    def on_mma(self) -> bool:
        return self.mma and self.rows >= MMA_MIN_ROWS and not self.on_dense

    def set_rows(self, rows: int) -> None:
        """The row count of the launches that follow; past TOK_TILE rows this writes the GEMM's row table (one
        launch, shared by every matrix of the step)."""
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"{rows} rows: laid out for 1 to {self.max_rows}")
        self.rows, self._dense = rows, self.dense_at(rows)
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
        if self.on_dense:
            return StepRows(x, None, self.linear.as_weight_dtype(x))
        if not self.on_mma:
            return StepRows(x, None)
        n = self.tiles * self.config.block_m
        xs = self.rows_bf16[: n * K].reshape(n, K)
        launch_moe_gather_bf16(x, self.sorted_ids[:n], self.num_tiles, 1, self.config.block_m, xs, stream=self.stream)
        return StepRows(x, xs)

    def apply(self, matrix: Matrix8Bit, rows: StepRows, out, accumulate: bool = False) -> None:
        """out [R, n_out] float32 = (accumulate: +=) rows @ matrix^T, every element written."""
        st = self.stream
        if rows.xc is not None:
            dense = self._widened_view(matrix.n_out, matrix.n_in)
            self._widening(matrix, dense).launch(st)
            self.linear.linear(rows.x, dense, out, accumulate=accumulate, force_cublas=True, xc=rows.xc)
            return
        if rows.xs is None:
            layout = matrix.host_meta if self.layout_at_launch else None
            args = (matrix.code, matrix.n_out, out, self.bounds, st, accumulate, self.stream_shape, layout)
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
            splits=self._splits(self.rows, matrix, self.config),
            partials=self.partials,
        )

    def _widening(self, matrix: Matrix8Bit, dense) -> MatrixWidening:
        """The matrix's widening into the scratch, made on its first widened step."""
        if (known := self._widenings.get(id(matrix))) is None:
            widening = MatrixWidening(matrix.block, matrix.meta, matrix.code, matrix.n_out, matrix.n_in, dense)
            known = self._widenings[id(matrix)] = (matrix, widening)
        return known[1]

    def _widened_view(self, n_out: int, n_in: int):
        """The scratch's first n_out x n_in elements as [n_out, n_in]."""
        if (view := self._widened_views.get((n_out, n_in))) is None:
            assert self.widened is not None
            if n_out * n_in > self.widened.size:
                raise ValueError(f"a [{n_out}, {n_in}] matrix does not fit the {self.widened.size}-element scratch")
            view = self._widened_views[n_out, n_in] = self.widened[: n_out * n_in].reshape(n_out, n_in)
        return view
