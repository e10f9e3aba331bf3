"""L2 prefetch of a decode step's weights a kernel or two before they are streamed (CudaOptions.l2_prefetch).

At one token a layer is a chain of short kernels; each weight stream (q|k|v, o, the router, the experts) waits a
memory latency for its first bytes and leaves the HBM idle while it ramps up and drains, and the kernels between
them (norms, attention at a short context, the router's top-k) read almost nothing. Two prefetch launches a layer
(kernels/l2_prefetch.py, one warp each) keep the HBM busy through those gaps:
- after the q|k|v projection: this layer's o projection and router rows, read once attention is done;
- after the router: the picked experts' blocks (bytes the L2 can hold: their down rows only where whole blocks
  would not fit EXPERT_BYTES) and the next layer's q|k|v rows.
A prefetch is a hint: nothing computed depends on it, so outputs are bit for bit those without it.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from expert_service.cuda.driver import device_address
from expert_service.kernels import expert_quant
from expert_service.kernels.l2_prefetch import check_ranges, launch_prefetch, supported

EXPERT_BYTES = 24 << 20  # a step's picked experts warmed at most: about half the H100's / H200's 50 MB L2


class L2Warmer:
    """The prefetch tables of every layer, on the device, and the two launches a MoE layer that read them (one a
    dense layer). Built only where the device runs the bulk prefetch (`make`)."""

    @classmethod
    def make(cls, config, weights, stream) -> L2Warmer | None:
        """The warmer, or None on a device before sm_90 (CudaOptions.l2_prefetch then does nothing)."""
        return cls(config, weights, stream) if supported() else None

    def __init__(self, config, weights, stream):
        self.config, self.weights, self.stream = config, weights, stream
        self.buffer = weights.dense_buffer
        base, end = device_address(self.buffer), device_address(self.buffer) + self.buffer.nbytes

        def ranges(arrays) -> list[list[int]]:
            rows = []
            for a in arrays:
                if a is None:
                    continue
                lo, hi = device_address(a), device_address(a) + a.nbytes
                if base <= lo and hi <= end:  # a view of the dense buffer (every dense weight is)
                    start = (lo - base) // 16 * 16
                    rows.append([start, -(-(hi - base) // 16) * 16 - start])
            return rows

        L = config.num_hidden_layers
        per_layer = [ranges([self._o(i), weights.layer(i, "router")]) for i in range(L)]
        per_layer += [ranges(self._qkv(i + 1)) if i + 1 < L else [] for i in range(L)]
        # one table for every layer (one allocation; row 0 prefetches nothing: a layer without ranges reads it)
        rows, spans = [[0, 0]], []
        for layer_rows in per_layer:
            spans.append((len(rows), len(rows) + len(layer_rows)) if layer_rows else (0, 1))
            rows += layer_rows
        if len(rows) > 1:
            check_ranges(rows[1:], self.buffer.nbytes)
        self.table = cuda.to_device(np.asarray(rows, np.int64), stream=stream)
        self.after_qkv = [self.table[a:b] for a, b in spans[:L]]
        self.after_router = [self.table[a:b] for a, b in spans[L:]]
        self.expert_bytes = {layer: self._expert_range(layer) for layer in weights.experts}

    def _o(self, i: int):
        projections = self.weights.attention_8bit
        return projections[i].o.block if projections is not None else self.weights.layer(i, "o_proj")

    def _qkv(self, i: int) -> list:
        if self.weights.attention_8bit is not None:
            return [self.weights.attention_8bit[i].qkv.block]
        stacked = self.weights.layer(i, "qkv_proj")
        if stacked is not None:
            return [stacked]
        return [self.weights.layer(i, f"{p}_proj") for p in ("q", "k", "v")]

    def _expert_range(self, layer: int) -> tuple[int, int] | None:
        """Bytes [lo, hi) of each picked expert's block to warm: the whole block (codes and scales) if K of them fit
        EXPERT_BYTES, else from the down rows on (read last; the three scale tensors follow them), None if even
        those do not fit."""
        cfg, w = self.config, self.weights
        K, F, D = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hidden_size
        stride = w.expert_strides[layer]
        if w.quantized:
            meta = w.expert_meta_host[layer]
            if len({tuple(row) for row in meta}) != 1:
                return None  # mixed dtypes: each expert's down offset differs
            code, scheme = int(meta[0, 0]), int(meta[0, 1])
            offsets = expert_quant.block_offsets(code, scheme, F, D)
            assert tuple(int(o) for o in meta[0, 2:8]) == offsets[:6]  # the layout the kernels read
            down, used = offsets[2], offsets[6]
        else:
            item = w.dtype.itemsize
            down, used = 2 * F * D * item, 3 * F * D * item
        used = min(-(-used // 16) * 16, stride)
        for lo in (0, down // 16 * 16):
            if K * (used - lo) <= EXPERT_BYTES:
                return lo, used
        return None

    def attention(self, i: int) -> None:
        """After layer i's q|k|v launch: its o projection and router."""
        launch_prefetch(self.buffer, self.after_qkv[i], stream=self.stream)

    def experts(self, i: int, ids, resident: bool) -> None:
        """After layer i's router wrote ids: the picked experts (resident ones only: the expert cache's slots are
        filled by its own copies) and the next layer's q|k|v (none after the last layer)."""
        span = self.expert_bytes.get(i) if resident else None
        if span is None:
            if i + 1 < self.config.num_hidden_layers:
                launch_prefetch(self.buffer, self.after_router[i], stream=self.stream)
            return
        lo, hi = span
        experts = self.weights.experts[i]
        launch_prefetch(self.buffer, self.after_router[i], experts=experts, ids=ids, lo=lo, hi=hi, stream=self.stream)
