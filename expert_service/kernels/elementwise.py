"""Elementwise ops on float32 activations (numpy references: expert_service.cpu.layers.moe.silu / swiglu_mlp,
expert_service.cpu.decoder.CpuDecoder: bias add, clip_qkv, shared-expert sigmoid gate).

silu_mul:        h = silu(g) * u                         (g, u, h [R, F]; silu(x) = x / (1 + exp(-x)))
silu_mul_halves: h[r] = silu(gu[r, :F]) * gu[r, F:]   (gu [R, 2F] f32 or h's dtype, h [R, F] f32/f16/bf16:
                 per-expert cuBLAS writes a token's gate and up projections as one row; computed in float32,
                 rounded once; bf16 rows with F % 4 == 0 go as 8-byte words of 4 values)
sigmoid_gate_add: out[t, :] += shared[t, :] / (1 + exp(-gate_logit[t]))   (Qwen2-MoE shared expert)
clamp:           x = clip(x, lo, hi) in place           (OLMoE clip_qkv)
add_bias:        y[t, :] += bias[:]                      (bias [N] W)
cast:            out = round(x) to bfloat16 bits / float16 (activations for 16-bit GEMMs)

All kernels run over flat C-contiguous views with a grid-stride loop (one element per thread per step,
coalesced); grids are capped at MAX_BLOCKS so big tensors reuse resident blocks. Pure bandwidth.
The cast is the exception, being the one run over whole prefill activations (T x 6144 and more): a thread
loads CAST_WORDS words of 4 floats (two 8-byte loads each) before it stores them as 8-byte words of 4 16-bit
values, and the grid covers every word. One element a step would keep one 4-byte load a thread in flight (the
next step's load cannot move above a store the compiler must assume aliases it), too few bytes for the
bandwidth, and a 2-byte store per element. Elements past the last whole word, and every element of arrays not
8-byte aligned, take the one-element path.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, types

from expert_service.kernels.jit_cache import cached_jit
from expert_service.kernels.numeric import aligned_to, bf16_to_f32, f32_to_bf16, loader, packer4, silu, storer, widener

THREADS = 256
MAX_BLOCKS = 1024   # 132 SMs x 8 resident blocks of 256 threads; beyond that the stride loop covers the rest
CAST_WORDS = 4      # words of 4 elements a cast thread converts at once (8 loads of 8 bytes in flight)
MAX_GRID_ROWS = 65535   # a grid's y extent: silu_mul_halves' blocks stride over more rows than this


def silu_mul_kernel(g, u, h):
    """g, u, h: [n] float32 flat views; h = silu(g) * u (h may alias g or u)."""
    for i in range(cuda.grid(1), h.shape[0], cuda.gridsize(1)):
        x = g[i]
        h[i] = silu(x) * u[i]


def sigmoid_gate_add_kernel(out, shared, gate_logit):
    """out, shared: [T, D] float32 (out += sigmoid(gate_logit[t]) * shared). gate_logit: [T] float32."""
    d = out.shape[1]
    for i in range(cuda.grid(1), out.shape[0] * d, cuda.gridsize(1)):
        t = i // d
        c = i - t * d
        out[t, c] += shared[t, c] / (np.float32(1.0) + math.exp(-gate_logit[t]))


def clamp_kernel(x, lo, hi):
    """x: [n] float32 flat view, clipped to [lo, hi] in place (NaN stays NaN, like numpy.clip)."""
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        v = x[i]
        if v < lo:
            x[i] = lo
        elif v > hi:
            x[i] = hi


@functools.cache
def _build_bias(weight_dtype):
    widen = widener(weight_dtype)

    def add_bias_kernel(y, bias):
        """y: [T, N] float32, += bias. bias: [N] W."""
        n = y.shape[1]
        for i in range(cuda.grid(1), y.shape[0] * n, cuda.gridsize(1)):
            t = i // n
            c = i - t * n
            y[t, c] += widen(bias[c])

    return add_bias_kernel, cached_jit(add_bias_kernel)


@functools.cache
def _build_silu_mul_halves(gu_dtype, h_dtype):
    load, store = loader(gu_dtype), storer(h_dtype)

    def silu_mul_halves_kernel(gu, h, F, r0, r1):
        """gu: [N * 2F] flat view of gu_dtype ([N, 2F]: each row's gate, then up projections); h: [N * F] flat of
        h_dtype; rows [r0, r1) are computed. Grid (column blocks, row blocks): blocks stride over rows by
        gridDim.y (the grid's y extent is capped at 65535), their threads over the F columns."""
        for r in range(r0 + cuda.blockIdx.y, r1, cuda.gridDim.y):
            gate, out = r * 2 * F, r * F
            for j in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, F,
                           cuda.gridDim.x * cuda.blockDim.x):
                x = load(gu, gate + j)
                store(h, out + j, silu(x) * load(gu, gate + F + j))

    return silu_mul_halves_kernel, cached_jit(silu_mul_halves_kernel)


def silu_mul_halves_bf16_kernel(gu4, h4, F4, r0, r1):
    """silu_mul_halves on bfloat16 rows as 8-byte words of 4 values (F = 4 * F4): gu4 [N * 2 * F4] uint64,
    h4 [N * F4] uint64, rows [r0, r1). Grid as the element kernel's; one 8-byte load of gate and of up and one
    store per word (2-byte accesses reached 1.4 TB/s on the H200)."""
    mask = np.uint64(0xFFFF)
    for r in range(r0 + cuda.blockIdx.y, r1, cuda.gridDim.y):
        gate, out = r * 2 * F4, r * F4
        for j in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, F4, cuda.gridDim.x * cuda.blockDim.x):
            g, u = gu4[gate + j], gu4[gate + F4 + j]
            word = np.uint64(0)
            for q in range(4):
                shift = np.uint64(16 * q)
                x = bf16_to_f32(np.uint16((g >> shift) & mask))
                y = bf16_to_f32(np.uint16((u >> shift) & mask))
                word |= np.uint64(f32_to_bf16(silu(x) * y)) << shift
            h4[out + j] = word


_silu_mul_halves_bf16 = cached_jit(silu_mul_halves_bf16_kernel)


@functools.cache
def _build_cast(out_dtype):
    store = storer(out_dtype)
    pack4 = packer4(out_dtype)

    def cast_kernel(x, out, x2, out4):
        """x: [n] float32 flat view. out: [n] uint16 (bfloat16 bits, round to nearest even) or float16.
        x2: [2 * W] uint64, x[:4 * W] as float32 pairs; out4: [W] uint64, out[:4 * W] as words of 4 (W = 0
        where x or out is not 8-byte aligned). Thread i converts words i, i + gridsize, ... (CAST_WORDS of
        them) at once, grid-striding; then elements 4 * W .. n - 1 one a thread."""
        stride = cuda.gridsize(1)
        lo = cuda.local.array(CAST_WORDS, np.uint64)
        hi = cuda.local.array(CAST_WORDS, np.uint64)
        for base in range(cuda.grid(1), out4.shape[0], CAST_WORDS * stride):
            for j in range(CAST_WORDS):          # every load before any store (see the module docstring)
                q = base + j * stride
                if q < out4.shape[0]:
                    lo[j], hi[j] = x2[2 * q], x2[2 * q + 1]
            for j in range(CAST_WORDS):
                q = base + j * stride
                if q < out4.shape[0]:
                    out4[q] = pack4(lo[j], hi[j])
        for i in range(4 * out4.shape[0] + cuda.grid(1), x.shape[0], stride):
            store(out, i, x[i])

    return cast_kernel, cached_jit(cast_kernel)


_silu_mul = cached_jit(silu_mul_kernel)
_sigmoid_gate_add = cached_jit(sigmoid_gate_add_kernel)
_clamp = cached_jit(clamp_kernel)


def _grid(n, threads):
    return max(1, min(MAX_BLOCKS, -(-n // threads)))


def _flat(*arrays):
    for a in arrays:
        assert a.flags["C_CONTIGUOUS"], "elementwise ops need contiguous arrays"
    return [a.reshape(-1) for a in arrays]


def launch_silu_mul(g, u, h, stream=0, threads=THREADS) -> None:
    """g, u, h: same-shape float32 device arrays (any rank); h = silu(g) * u, h may be g or u."""
    assert g.shape == u.shape == h.shape and g.dtype == u.dtype == h.dtype == np.float32, (g.shape, u.shape, h.shape)
    if h.size:
        _silu_mul[_grid(h.size, threads), threads, stream](*_flat(g, u, h))


def launch_silu_mul_halves(gu, h, stream=0, threads=THREADS) -> None:
    """gu: [R, 2F] (a row's gate then up projections), h: [R, F]; both C-contiguous, h float32, float16 or uint16
    (bfloat16 bits), gu of h's dtype or float32. h = silu(gu[:, :F]) * gu[:, F:] in float32, rounded to h's dtype
    once."""
    launcher = SiluMulHalves(gu, h, threads)
    if h.size:
        launcher(0, h.shape[0], stream)


class SiluMulHalves:
    """silu_mul_halves on rows of fixed buffers, its flat views made once: a call costs one launch, where slicing
    and viewing Numba device arrays for every call costs tens of microseconds each (the per-expert GEMMs' host
    break issues one a layer, or one a group of 8-bit experts)."""

    def __init__(self, gu, h, threads=THREADS):
        """gu [N, 2F], h [N, F] as launch_silu_mul_halves takes them; a call computes rows [r0, r1) of them."""
        R, F = h.shape
        assert gu.shape == (R, 2 * F) and np.dtype(gu.dtype) in (np.dtype(h.dtype), np.dtype(np.float32)), (
            gu.shape, h.shape, gu.dtype, h.dtype)
        assert np.dtype(h.dtype) in (np.float32, np.float16, np.uint16), h.dtype
        flat_gu, flat_h = _flat(gu, h)
        self.rows, self.threads = R, threads
        if gu.dtype == h.dtype == np.uint16 and F % 4 == 0 and aligned_to(8, flat_gu, flat_h):
            self.kernel, self.args = _silu_mul_halves_bf16, (flat_gu.view(np.uint64), flat_h.view(np.uint64))
            self.columns = F // 4
        else:
            self.kernel = _build_silu_mul_halves(np.dtype(gu.dtype), np.dtype(h.dtype))[1]
            self.args, self.columns = (flat_gu, flat_h), F

    def __call__(self, r0: int, r1: int, stream=0) -> None:
        """Rows [r0, r1) (0 <= r0 < r1 <= the buffers' rows)."""
        assert 0 <= r0 < r1 <= self.rows, (r0, r1, self.rows)
        row_blocks = min(r1 - r0, MAX_GRID_ROWS)
        blocks = max(1, min(-(-self.columns // self.threads), MAX_BLOCKS // min(row_blocks, MAX_BLOCKS)))
        self.kernel[(blocks, row_blocks), self.threads, stream](*self.args, np.int32(self.columns), np.int32(r0),
                                                                 np.int32(r1))


def launch_sigmoid_gate_add(out, shared, gate_logit, stream=0, threads=THREADS) -> None:
    """out: [T, D] float32, += sigmoid(gate_logit[t]) * shared[t]; shared: [T, D] float32; gate_logit: [T] or
    [T, 1] float32 (x @ shared_expert_gate.T)."""
    assert out.ndim == 2 and shared.shape == out.shape and out.dtype == shared.dtype == np.float32
    assert gate_logit.size == out.shape[0] and gate_logit.dtype == np.float32, (gate_logit.shape, out.shape)
    _flat(out, shared, gate_logit)
    if out.size:
        _sigmoid_gate_add[_grid(out.size, threads), threads, stream](out, shared, gate_logit.reshape(-1))


def launch_clamp(x, limit, stream=0, threads=THREADS) -> None:
    """x: float32 device array (any rank), clipped in place to [-limit, limit] (clip_qkv)."""
    assert x.dtype == np.float32, x.dtype
    if x.size:
        _clamp[_grid(x.size, threads), threads, stream](_flat(x)[0], np.float32(-limit), np.float32(limit))


def launch_add_bias(y, bias, stream=0, threads=THREADS) -> None:
    """y: [T, N] float32, += bias in place; bias: [N] float32/float16/uint16 (bfloat16 bits)."""
    assert y.ndim == 2 and y.dtype == np.float32 and bias.shape == (y.shape[1],), (y.shape, bias.shape)
    assert bias.dtype in (np.float32, np.float16, np.uint16), bias.dtype
    _flat(y, bias)
    if y.size:
        _build_bias(np.dtype(bias.dtype))[1][_grid(y.size, threads), threads, stream](y, bias)


def launch_cast(x, out, stream=0, threads=THREADS) -> None:
    """x: float32 device array; out: same shape, uint16 (bfloat16 bits, round to nearest even) or float16."""
    assert x.shape == out.shape and x.dtype == np.float32 and out.dtype in (np.uint16, np.float16), out.dtype
    if not x.size:
        return
    flat_x, flat_out = _flat(x, out)
    n = flat_x.shape[0]
    main = n - n % 4 if aligned_to(8, flat_x, flat_out) else 0
    x2, out4 = ((a if main == n else a[:main]).view(np.uint64) for a in (flat_x, flat_out))
    # uncapped: CAST_WORDS words a thread (the unaligned case: one element a thread)
    blocks = max(1, -(-(main // 4) // (CAST_WORDS * threads)), -(-(n - main) // threads))
    _build_cast(np.dtype(out.dtype))[1][blocks, threads, stream](flat_x, flat_out, x2, out4)


def sm90_signatures():
    """(python function, numba signature) of every variant, for the sm_90 compile check."""
    f1, f2 = types.float32[::1], types.float32[:, ::1]
    out = [(silu_mul_kernel, (f1, f1, f1)), (sigmoid_gate_add_kernel, (f2, f2, f1)),
           (clamp_kernel, (f1, types.float32, types.float32))]
    for dt, nb in ((np.float32, types.float32), (np.float16, types.float16), (np.uint16, types.uint16)):
        out.append((_build_bias(np.dtype(dt))[0], (f2, nb[::1])))
    for dt, nb in ((np.float16, types.float16), (np.uint16, types.uint16)):
        out.append((_build_cast(np.dtype(dt))[0], (f1, nb[::1], types.uint64[::1], types.uint64[::1])))
    for dt, nb in ((np.float32, types.float32), (np.float16, types.float16), (np.uint16, types.uint16)):
        for gu_dt, gu_nb in ((dt, nb), (np.float32, types.float32)):
            out.append((_build_silu_mul_halves(np.dtype(gu_dt), np.dtype(dt))[0],
                        (gu_nb[::1], nb[::1], types.int32, types.int32, types.int32)))
    out.append((silu_mul_halves_bf16_kernel,
                (types.uint64[::1], types.uint64[::1], types.int32, types.int32, types.int32)))
    return out
