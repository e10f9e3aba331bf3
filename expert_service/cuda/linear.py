"""Linear layers on the cuda backend: weight streaming for one token, cuBLAS for more.

A step of at most GEMV_MAX_TOKENS rows is memory-bound: the weight-streaming GEMV kernels (kernels.gemv:
16-byte streaming loads, fused bias / residual add / SwiGLU) read each weight once at close to HBM
bandwidth. More rows go through cuBLAS on tensor cores (a dedicated handle, so CUDA graphs can capture
it), after a cast of the activations to the weights' dtype (cuBLAS takes both operands in one type).
Used by the decoder (q/k/v/o, dense MLP, LM head) and the MoE layer (router, shared expert, per-expert
GEMMs of the expert cache).
"""

from __future__ import annotations

import numpy as np

from expert_service.cuda.cublas import Cublas
from expert_service.kernels import elementwise
from expert_service.kernels.gemv import launch_gemv, launch_gemv_swiglu

GEMV_MAX_TOKENS = 1  # rows up to which the GEMV kernels beat cuBLAS (one token: decode b=1)


class DeviceLinear:
    """y = x @ W^T on `stream`: GEMV for few rows, `cublas` otherwise. `workspace.cast` (present when the
    weights are 16-bit) holds the activations cast to `weights_dtype`."""

    def __init__(self, stream, cublas: Cublas, workspace, weights_dtype: np.dtype):
        self.stream, self.cublas, self.workspace, self.weights_dtype = stream, cublas, workspace, weights_dtype

    def linear(self, x, weight, out, bias=None, accumulate: bool = False, force_cublas: bool = False, xc=None) -> None:
        """out [M, N] (+)= x [M, K] @ weight [N, K]^T (+ bias). xc: x already in the weights' dtype (one cast
        shared by several projections of the same input)."""
        if x.shape[0] <= GEMV_MAX_TOKENS and not force_cublas:
            launch_gemv(x, weight, out, bias=bias, accumulate=accumulate, stream=self.stream)
            return
        self.cublas.linear(xc if xc is not None else self.as_weight_dtype(x), weight, out, accumulate=accumulate)
        if bias is not None:
            elementwise.launch_add_bias(out, bias, stream=self.stream)

    def swiglu(self, x, gate, up, out, scratch, force_cublas: bool = False) -> None:
        """out = silu(x @ gate^T) * (x @ up^T); scratch [M, F] holds the up projection on the cuBLAS path."""
        if x.shape[0] <= GEMV_MAX_TOKENS and not force_cublas:
            launch_gemv_swiglu(x, gate, up, out, stream=self.stream)
            return
        xc = self.as_weight_dtype(x)
        self.cublas.linear(xc, gate, out)
        self.cublas.linear(xc, up, scratch)
        elementwise.launch_silu_mul(out, scratch, out, stream=self.stream)

    def as_weight_dtype(self, x):
        """x [rows, cols] f32 in the weights' dtype: x itself for fp32 weights, else a view of workspace.cast."""
        if self.weights_dtype == np.float32:
            return x
        rows, cols = x.shape
        xc = self.workspace.cast[: rows * cols].reshape(rows, cols)
        elementwise.launch_cast(x, xc, stream=self.stream)
        return xc
