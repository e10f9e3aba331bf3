"""cuBLAS through ctypes on a dedicated handle, for the large GEMMs of prefill where tensor cores pay.

A dedicated handle with its own preallocated workspace keeps calls capturable in CUDA graphs (CuPy's
shared handle refuses capture). Row-major Y[M, N] = X[M, K] @ W[N, K]^T is the
column-major product Y^T = W^T' * X^T, i.e. gemm(transa=T, transb=N, m=N, n=M, k=K).
"""

from __future__ import annotations

import ctypes

import numpy as np

from expert_service.cuda.driver import device_address

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 * 1024 * 1024
DATA_TYPES = {np.dtype(np.float32): CUDA_R_32F, np.dtype(np.float16): CUDA_R_16F, np.dtype(np.uint16): CUDA_R_16BF}


def _load_library() -> ctypes.CDLL:
    from cuda.pathfinder import load_nvidia_dynamic_lib

    return ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)


class CublasError(RuntimeError):
    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status  # the cublasStatus_t (CUBLAS_STATUS_ALLOC_FAILED: out of device memory)


class Cublas:
    def __init__(self, stream, workspace):
        """`workspace`: a preallocated device byte array of at least WORKSPACE_BYTES (memory plan)."""
        self.lib = _load_library()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        from expert_service.cuda.driver import stream_handle

        self._check(
            self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(int(stream_handle(stream)))), "cublasSetStream"
        )
        self._check(
            self.lib.cublasSetWorkspace_v2(
                self.handle, ctypes.c_void_p(workspace.device_ctypes_pointer.value), ctypes.c_size_t(workspace.nbytes)
            ),
            "cublasSetWorkspace",
        )
        self.workspace = workspace  # the handle holds its address only: the array lives as long as this object
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise CublasError(f"{what} failed with cuBLAS status {status}", status)

    def linear(self, x, w, y, accumulate: bool = False) -> None:
        """y [M, N] f32 (+)= x [M, K] @ w [N, K]^T; x and w of the same dtype (f32, f16 or bf16-as-uint16)."""
        M, K = x.shape
        N = w.shape[0]
        if w.shape[1] != K or y.shape != (M, N) or x.dtype != w.dtype or y.dtype != np.float32:
            raise ValueError(f"linear: x {x.shape} {x.dtype}, w {w.shape} {w.dtype}, y {y.shape} {y.dtype}")
        self._gemm(
            device_address(w),
            device_address(x),
            device_address(y),
            M,
            N,
            K,
            DATA_TYPES[np.dtype(w.dtype)],
            self._one if accumulate else self._zero,
        )

    def _gemm(
        self, w: int, x: int, y: int, m: int, n: int, k: int, data_type: int, beta, out_type: int = CUDA_R_32F
    ) -> None:
        """Row-major Y [m, n] = X [m, k] @ W [n, k]^T (+ beta * Y) on raw device addresses; Y f32 (out_type:
        the weights' type too, rounded from the f32 accumulation)."""
        self._check(
            self.lib.cublasGemmEx(
                self.handle,
                CUBLAS_OP_T,
                CUBLAS_OP_N,
                n,
                m,
                k,
                ctypes.byref(self._one),
                ctypes.c_void_p(w),
                data_type,
                k,
                ctypes.c_void_p(x),
                data_type,
                k,
                ctypes.byref(beta),
                ctypes.c_void_p(y),
                out_type,
                n,
                CUBLAS_COMPUTE_32F,
                CUBLAS_GEMM_DEFAULT,
            ),
            "cublasGemmEx",
        )

    def linear_batched(
        self, x, x_stride: int, w, w_offset: int, w_stride: int, n: int, k: int, y, y_stride: int, batch: int, rows: int
    ) -> None:
        """For b < batch: y_b [rows, n] f32 = x_b [rows, k] @ W_b[n, k]^T, one strided-batched call.
        x_b starts x_stride elements after x_{b-1} (0: the same input for every b); W_b is the [n, k] matrix
        starting w_offset + b * w_stride elements into `w` (experts of a layer: stride = the expert block);
        y_b starts y_stride elements after y_{b-1}."""
        dtype = DATA_TYPES[np.dtype(w.dtype)]
        if np.dtype(x.dtype) != np.dtype(w.dtype) or y.dtype != np.float32:
            raise ValueError(f"linear_batched: x {x.dtype}, w {w.dtype}, y {y.dtype}")
        item = np.dtype(w.dtype).itemsize
        self._check(
            self.lib.cublasGemmStridedBatchedEx(
                self.handle,
                CUBLAS_OP_T,
                CUBLAS_OP_N,
                n,
                rows,
                k,
                ctypes.byref(self._one),
                ctypes.c_void_p(w.device_ctypes_pointer.value + w_offset * item),
                dtype,
                k,
                ctypes.c_longlong(w_stride),
                ctypes.c_void_p(x.device_ctypes_pointer.value),
                dtype,
                k,
                ctypes.c_longlong(x_stride),
                ctypes.byref(self._zero),
                ctypes.c_void_p(y.device_ctypes_pointer.value),
                CUDA_R_32F,
                n,
                ctypes.c_longlong(y_stride),
                batch,
                CUBLAS_COMPUTE_32F,
                CUBLAS_GEMM_DEFAULT,
            ),
            "cublasGemmStridedBatchedEx",
        )

    def linear_each(
        self, w: np.ndarray, x: np.ndarray, y: np.ndarray, rows: np.ndarray, n: int, k: int, dtype, out_dtype=np.float32
    ) -> None:
        """For each g: Y_g [rows[g], n] = X_g [rows[g], k] @ W_g [n, k]^T, one cublasGemmEx each on raw
        device addresses (w, x, y: int64 host arrays): no device-array slicing, a few µs of host time per
        GEMM. X and W of `dtype`; Y of out_dtype (float32, or `dtype` itself). (cublasGemmGroupedBatchedEx
        would be one call, but cuBLAS 13.1 refuses 16-bit inputs with f32 outputs: CUBLAS_STATUS_NOT_SUPPORTED,
        measured on the H200.)"""
        data_type = DATA_TYPES[np.dtype(dtype)]
        if np.dtype(out_dtype) not in (np.dtype(np.float32), np.dtype(dtype)):
            raise ValueError(f"linear_each: {np.dtype(out_dtype)} outputs from {np.dtype(dtype)} inputs")
        out_type = DATA_TYPES[np.dtype(out_dtype)]
        for wg, xg, yg, m in zip(w.tolist(), x.tolist(), y.tolist(), rows.tolist()):
            self._gemm(wg, xg, yg, m, n, k, data_type, self._zero, out_type)

    def close(self) -> None:
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = ctypes.c_void_p()
