"""8-bit attention projections on the device: each layer's q, k, v and o as int8 or fp8 e4m3 rows with per-row
scales (cuda/linear_8bit.py runs them), in place of the dense GEMVs and cuBLAS GEMMs.

At one token q|k|v is one launch over the stacked rows (the format stores their codes back to back, then their
scales), as the dense path's fused GEMV: the k and v rows alone are too few to keep HBM busy. Past one token
q, k and v are three launches on the same input rows (past 4 rows one bf16 copy of them, made once), each writing
its own range of the workspace.
o_proj adds into the residual in its epilogue. Biases (Qwen2-MoE's q/k/v) stay dense, added after.
Steps of at least CudaOptions.attention_8bit_dense_rows tokens (prefill chunks, decode batches that large) widen each
projection in turn into one scratch as large as the largest of them (q_size x hidden_size in the dense dtype) and run
it on cuBLAS; q|k|v is then three launches at every size. The scratch is laid out only where the engine's options
reach it (a threshold within its step sizes).
"""

from __future__ import annotations

import numpy as np

from expert_service.cuda.linear_8bit import EightBitRows
from expert_service.cuda.weights import Projections8Bit
from expert_service.kernels import elementwise


class DeviceAttention8Bit:
    """Runs `layers` (DeviceWeights.attention_8bit) for steps of 1 to max_rows rows. `weights`: for the dense
    biases, if any, and the dense dtype; `linear` (DeviceLinear): cuBLAS for the widened projections of large steps
    (None: they stay on the 8-bit kernels)."""

    def __init__(
        self, layers: tuple[Projections8Bit, ...], weights, max_rows: int, stream, linear=None, dense_rows: int = 0
    ):
        """dense_rows: the engine's CudaOptions.attention_8bit_dense_rows (the scratch is laid out if it widens)."""
        self.layers, self.weights, self.stream = layers, weights, stream
        if not all(m.takes_mma for m in layers[0]):  # the format's sizes guarantee it
            raise ValueError("8-bit attention projections need outputs of whole 16-column tiles")
        first = layers[0]
        widest = max(first.q.n_in, first.o.n_in)  # q_size or hidden_size, in and out
        widen = self.scratch_elements(first.q.n_in, first.q.n_out) if widens(dense_rows, max_rows) else 0
        self.rows = EightBitRows(
            max_rows,
            widest,
            mma=True,
            stream=stream,
            split_outputs=widest,
            widen_elements=widen,
            dense_dtype=weights.dtype,
            linear=linear,
        )
        self.rows.use_dense_rows(dense_rows)

    @staticmethod
    def scratch_elements(hidden_size: int, q_size: int) -> int:
        """The widening scratch's elements: the largest projection, q [q_size, hidden] or o [hidden, q_size]."""
        return q_size * hidden_size

    def refusal(self, options) -> str | None:
        """Why `options` cannot run on these buffers (None: they can): a widening threshold within the steps when
        no scratch was laid out."""
        rows = options.attention_8bit_dense_rows
        if widens(rows, self.rows.max_rows) and self.rows.widened is None:
            return (
                f"cuda_options: attention_8bit_dense_rows {rows} needs the widening scratch the engine was not laid "
                "out with; give it to the engine's config instead"
            )
        return None

    def use_options(self, options) -> None:
        """CudaOptions.attention_8bit_dense_rows for the passes that follow (refused, one line, where `refusal`
        says so)."""
        if (why := self.refusal(options)) is not None:
            raise ValueError(why)
        self.rows.use_dense_rows(options.attention_8bit_dense_rows)

    def warmup_rows(self) -> tuple[int, ...]:
        """The forward passes' token counts that load every kernel the projections launch (each layer's are the
        first layer's shapes)."""
        first = self.layers[0]
        return self.rows.warmup_rows(range(1, self.rows.max_rows + 1), (first.q, first.k, first.v, first.o))

    @staticmethod
    def planned_nbytes(hidden_size: int, q_size: int, max_rows: int, dense_dtype, dense_rows: int) -> int:
        """The device bytes __init__ allocates (its launch tables, bf16 rows, split-K partials and, where dense_rows
        widens, the scratch: q and o are the largest projections), for the device-memory plan."""
        widest = max(hidden_size, q_size)
        scratch = DeviceAttention8Bit.scratch_elements(hidden_size, q_size) if widens(dense_rows, max_rows) else 0
        widen_bytes = scratch * np.dtype(dense_dtype).itemsize
        return EightBitRows.planned_nbytes(max_rows, widest, mma=True, split_outputs=widest, widen_bytes=widen_bytes)

    def start_pass(self, rows: int) -> None:
        """Every launch until the next call runs `rows` rows (a forward pass's T)."""
        self.rows.set_rows(rows)

    def qkv(self, i: int, x, q, k, v, stacked, fused: bool) -> None:
        """x [T, D] float32 (the normed input) -> q [T, q_size], k and v [T, kv_size] float32 with their biases;
        stacked: at T = 1 the row [1, q_size + 2 kv_size] that q, k and v are views of (fused: one launch writes
        it), else None."""
        p, rows, w = self.layers[i], self.rows.inputs(x), self.weights
        qkv_bias = w.layer(i, "qkv_bias")
        stacked_ok = qkv_bias is not None or w.layer(i, "q_bias") is None
        # widened steps take the three projections (the scratch holds the largest one, not the stacked rows)
        if fused and stacked is not None and stacked_ok and not self.rows.on_dense:
            self.rows.apply(p.qkv, rows, stacked)
            if qkv_bias is not None:
                elementwise.launch_add_bias(stacked, qkv_bias, stream=self.stream)
            return
        for name, matrix, out in (("q", p.q, q), ("k", p.k, k), ("v", p.v, v)):
            self.rows.apply(matrix, rows, out)
            if (bias := w.layer(i, f"{name}_bias")) is not None:
                elementwise.launch_add_bias(out, bias, stream=self.stream)

    def o(self, i: int, attn, h) -> None:
        """h [T, D] float32 += attn [T, q_size] @ o_proj^T (+ its bias, if any)."""
        self.rows.apply(self.layers[i].o, self.rows.inputs(attn), h, accumulate=True)
        if (bias := self.weights.layer(i, "o_bias")) is not None:
            elementwise.launch_add_bias(h, bias, stream=self.stream)


def widens(dense_rows: int, max_rows: int) -> bool:
    """Whether a threshold of dense_rows (CudaOptions.attention_8bit_dense_rows) widens steps of up to max_rows."""
    return 0 < dense_rows <= max_rows
