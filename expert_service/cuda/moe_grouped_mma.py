"""The GROUPED_MMA strategy of the MoE block (cuda/moe_strategy.py chooses it): every routed expert of a layer on tensor
cores, one launch per expert matrix, no host synchronisation (graph-capturable at any T).

Per MoE layer, with cfg = choose_config(T*K, E), BM = cfg.block_m, tiles = max_tiles(T*K, E, BM), rows = tiles*BM:
  moe_align        ids [T, K] -> sorted_ids [rows] (assignments sorted by expert, padded to BM; -1: padding),
                   tile_expert [tiles], num_tiles [1] (device-side count: the GEMM grids use the host bound
                   `tiles`, tiles past num_tiles exit), position [T*K] (unused here: the store combine below
                   writes y in assignment order)
  moe_gather_bf16  x [T, D] f32 -> xs [rows, D] bf16 in sorted order (zeros in padding rows)
  moe_gemm_gate_up xs -> h [rows, F] bf16 = silu(xs gate^T) * (xs up^T)   (mma.sync bf16, fp32 accumulation)
  moe_gemm_down    h -> y = moe_out [T*K, D] f32 (combine="store": row t*K + k, not atomics)
  moe_combine      residual[t] += sum_k weights[t, k] * y[t*K + k]   (identity position: fixed order)
The store epilogue plus the existing combine is bitwise reproducible (graph == eager, run to run); the atomic
epilogue measured 1-6% faster but sums in arrival order. Kernels and H200 figures: docs/kernels.md.

On an sm_90 device, steps with at least WGMMA_MIN_ROWS rows per routed expert (CudaOptions.wgmma_experts) run
gate|up and down on `moe_gemm_wgmma` (bf16) or `moe_gemm_q8wgmma` (8-bit: widened into shared memory) instead:
Hopper warpgroup MMA on 128-byte swizzled stages, the same buffers and epilogues; the bf16 kernel measured
1.2-1.9x the mma.sync kernel's throughput at those sizes (docs/kernels.md).

Q8_MMA (every expert of the model int8 / fp8) is the same sequence with `moe_gemm_q8mma`'s gate|up and down
kernels, which read the layer's 8-bit blocks and their per-expert meta table (dtype code, scale scheme, offsets).

With CudaOptions.q8_activations, such 8-bit steps of at least CudaOptions.w8a8_min_rows rows per routed expert whose
layer has one 8-bit type and scale scheme (`w8a8_kind`) run W8A8 instead (`moe_gemm_w8a8`): `quantize_rows` writes
each sorted row's token in that type with a per-row scale (from float32 x, no bf16 gather), gate|up multiplies on the
8-bit tensor cores into bf16 h, `quantize_rows` quantizes h the same way (into the same buffer: the first GEMM no
longer reads it), then down. Block-scaled fp8, and steps under WGMMA_MIN_ROWS rows an expert, take the 64-row tile
(`moe_gemm_w8a8.config_for`).

Workspace (`grouped_mma_layout`, sized for every step of up to max_tokens): sorted_ids / xs / h of the largest
`max_rows` and tile_expert of the largest `max_tiles` over the tile configs the steps can take; num_tiles [1].
"""

from __future__ import annotations

import functools
from typing import NamedTuple, TypeGuard

import numpy as np
from numba import cuda

from expert_service.kernels.expert_quant import CODE_FP8, CODE_INT8, SCALE_BLOCK, SCALE_CHANNEL
from expert_service.kernels.moe_align import MAX_E as ALIGN_MAX_E
from expert_service.kernels.moe_align import launch_moe_align, launch_moe_gather_bf16, max_rows, max_tiles
from expert_service.kernels.moe_combine import launch_moe_combine
from expert_service.kernels.moe_gemm_mma import (
    COMBINE_STORE,
    choose_config,
    launch_moe_gemm_down,
    launch_moe_gemm_gate_up,
)
from expert_service.kernels.moe_gemm_q8mma import MIN_DIM as Q8_MMA_MIN_DIM
from expert_service.kernels.moe_gemm_q8mma import choose_config as choose_q8_config
from expert_service.kernels.moe_gemm_q8mma import launch_q8mma_down, launch_q8mma_gate_up
from expert_service.kernels.moe_gemm_q8wgmma import applies as q8wgmma_applies
from expert_service.kernels.moe_gemm_q8wgmma import launch_q8wgmma_down, launch_q8wgmma_gate_up
from expert_service.kernels.moe_gemm_w8a8 import applies as w8a8_applies
from expert_service.kernels.moe_gemm_w8a8 import config_for as w8a8_config
from expert_service.kernels.moe_gemm_w8a8 import launch_w8a8_down, launch_w8a8_gate_up
from expert_service.kernels.moe_gemm_wgmma import Config as WgmmaConfig
from expert_service.kernels.moe_gemm_wgmma import applies as wgmma_applies
from expert_service.kernels.moe_gemm_wgmma import choose_config as choose_wgmma_config
from expert_service.kernels.moe_gemm_wgmma import launch_wgmma_down, launch_wgmma_gate_up
from expert_service.kernels.numeric import SIMULATOR
from expert_service.kernels.quantize_rows import launch_quantize_gathered, launch_quantize_rows

# Rows per routed expert from which bf16 steps take the wgmma kernel (H200, bench/moe_gemm.py: 1.24x mma.sync at
# 128 rows on qwen3moe-shape, 1.73x at 128 on mixtral-shape; 0.9x at 32, where both stream weights).
WGMMA_MIN_ROWS = 96


@functools.cache
def hopper() -> bool:
    """Whether the current device runs sm_90a code (wgmma): compute capability 9.0 exactly (later chips build for
    their own arch-specific targets, which have no wgmma) and a real GPU."""
    return not SIMULATOR and cuda.get_current_device().compute_capability == (9, 0)


def wgmma_fits(n: int, E: int, F: int, D: int, quantized: bool = False) -> bool:
    """Whether a step of n assignments over E experts of these dims (bf16, or 8-bit when quantized) is one the
    wgmma kernels take (on sm_90)."""
    fits = q8wgmma_applies(F, D, 16) if quantized else wgmma_applies(F, D, 8)
    return fits and n >= WGMMA_MIN_ROWS * min(E, n)


class W8A8Kind(NamedTuple):
    """How a layer's steps run W8A8: the experts' 8-bit code and scale scheme, and the rows per routed expert from
    which a step takes it (CudaOptions.w8a8_min_rows)."""

    code: int
    block_scaled: bool
    min_rows: int = WGMMA_MIN_ROWS


def w8a8_kind(kinds, F: int, D: int, stride: int, min_rows: int = WGMMA_MIN_ROWS) -> W8A8Kind | None:
    """The W8A8Kind of a layer whose experts share one kind W8A8 runs (kinds: DeviceWeights.expert_kinds of the
    layer; int8 per channel, fp8 per channel or in 128x128 blocks) with dims it takes, else None."""
    if len(kinds) != 1 or not w8a8_applies(F, D, stride):
        return None
    code, scheme = kinds[0]
    if (code, scheme) not in ((CODE_INT8, SCALE_CHANNEL), (CODE_FP8, SCALE_CHANNEL), (CODE_FP8, SCALE_BLOCK)):
        return None
    return W8A8Kind(code, scheme == SCALE_BLOCK, min_rows)


def every_layer_w8a8(F: int, D: int, experts: dict, expert_kinds: dict, expert_strides: dict) -> bool:
    """Whether every MoE layer's experts are resident (experts: layer -> device blocks) and share one kind W8A8 runs
    (w8a8_kind of the layer's expert_kinds and stride in bytes): the DeviceWeights fields, fixed once loaded."""
    layers = expert_kinds.keys()
    return bool(layers) and all(
        i in experts and w8a8_kind(expert_kinds[i], F, D, expert_strides[i]) is not None for i in layers
    )


def grouped_tile(n: int, E: int, F: int, D: int, quantized: bool, wgmma: bool, w8a8: W8A8Kind | None = None):
    """The tile config of a step of n assignments over E experts where wgmma (CudaOptions.wgmma_experts) is on and
    the device is sm_90: moe_gemm_w8a8's for an 8-bit layer with a w8a8 kind (CudaOptions.q8_activations; the kind
    implies dims it takes) from its min_rows rows per routed expert; moe_gemm_wgmma's (the bf16 and the widening 8-bit wgmma kernels share it)
    where the dims fit and the step has at least WGMMA_MIN_ROWS rows per routed expert; else moe_gemm_q8mma's for
    8-bit layers and moe_gemm_mma's for bf16 ones."""
    if wgmma and quantized and w8a8 is not None and n >= w8a8.min_rows * min(E, n) and hopper():
        return w8a8_config(w8a8.block_scaled, wide=n >= WGMMA_MIN_ROWS * min(E, n))
    if wgmma and wgmma_fits(n, E, F, D, quantized) and hopper():
        return choose_wgmma_config(n, E)
    return choose_q8_config(n, E) if quantized else choose_config(n, E)


def step_tile(n: int, E: int, F: int, D: int, experts, quantized: bool, wgmma: bool, w8a8=None):
    """grouped_tile of a step on this layer's experts [E, stride]: the wgmma tiles only where each expert's block
    starts 16-byte aligned."""
    aligned = experts.shape[1] * experts.dtype.itemsize % 16 == 0
    return grouped_tile(n, E, F, D, quantized, wgmma and aligned, w8a8)


def takes_w8a8(w8a8: W8A8Kind | None, cfg, quantized: bool) -> TypeGuard[W8A8Kind]:
    """Whether an 8-bit (quantized) step on tile cfg runs W8A8: the layer has a w8a8_kind (with
    CudaOptions.q8_activations) and grouped_tile gave the step a warpgroup-MMA tile."""
    return quantized and w8a8 is not None and isinstance(cfg, WgmmaConfig)


def grouped_mma_layout(
    max_tokens: int, K: int, E: int, D: int, F: int, w8a8_min_rows: int = 0
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Workspace buffers of the strategy for steps of 1..max_tokens tokens (name -> (shape, dtype)); w8a8_min_rows:
    where W8A8 steps start (CudaOptions.w8a8_min_rows with q8_activations on an 8-bit model; 0: never), whose
    8-bit rows and their scales it lays out too."""
    rows = tiles = 1
    for T in range(1, max_tokens + 1):  # every tile config a step of T can take (options switch them freely)
        n = T * K
        block_ms = {choose_config(n, E).block_m, choose_q8_config(n, E).block_m}
        if wgmma_fits(n, E, F, D) or wgmma_fits(n, E, F, D, quantized=True):
            block_ms.add(choose_wgmma_config(n, E).block_m)
        if w8a8_min_rows and n >= w8a8_min_rows * min(E, n):  # either W8A8 tile (block-scaled fp8: the narrow one)
            block_ms |= {w8a8_config(False).block_m, w8a8_config(False, wide=False).block_m}
        # a smaller BM pads less but needs more tiles: each buffer takes its own largest need
        rows = max(rows, *(max_rows(n, E, bm) for bm in block_ms))
        tiles = max(tiles, *(max_tiles(n, E, bm) for bm in block_ms))
    i32, u16 = np.dtype(np.int32), np.dtype(np.uint16)
    layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {
        "mma_sorted_ids": ((rows,), i32),
        "mma_tile_expert": ((tiles,), i32),
        "mma_num_tiles": ((1,), i32),
        "mma_xs": ((rows, D), u16),
        "mma_h": ((rows, F), u16),
    }
    if w8a8_min_rows:  # the expert inputs, then (the first GEMM done) the SwiGLU rows, in 8 bits; one scale a row
        layout["mma_q8_rows"] = ((rows * max(D, F),), np.dtype(np.uint8))
        layout["mma_q8_scales"] = ((rows,), np.dtype(np.float32))
    return layout


def q8_mma_applies(config, all_8bit: bool, bf16: bool) -> bool:
    """Whether Q8_MMA's kernels can run this model's experts: every expert int8 / fp8 (a bf16 / fp16 / fp32 expert
    in a mixed layer: moe_q8 reads those), bf16 dense weights (the kernel's activations are bf16), D and F
    multiples of 16, and moe_align's expert limit."""
    D, F = config.hidden_size, config.moe_intermediate_size
    return (
        all_8bit and bf16 and D % Q8_MMA_MIN_DIM == 0 and F % Q8_MMA_MIN_DIM == 0 and config.num_experts <= ALIGN_MAX_E
    )


def cached_mma_possible(weight_dtype, quantized: bool, num_experts: int, q8_mma: bool = False) -> bool:
    """Whether the expert cache's grouped waves can run on a tensor-core kernel (CudaOptions.cached_mma): bf16
    experts on moe_gemm_mma, or 8-bit ones (q8_mma: q8_mma_applies) on moe_gemm_q8mma, each within moe_align's
    expert limit; mixed layers with 16-bit experts keep moe_q8."""
    if num_experts > ALIGN_MAX_E:
        return False
    return q8_mma if quantized else np.dtype(weight_dtype) == np.uint16


def run_grouped_mma(
    ws,
    stream,
    x,
    h,
    ids,
    weights,
    experts,
    F: int,
    D: int,
    combine=None,
    meta=None,
    wgmma: bool = False,
    w8a8: W8A8Kind | None = None,
) -> None:
    """x [T, D] normed input, h [T, D] residual (updated), ids / weights [T, K] (the layer's top-k on the
    device), experts [E, stride] bf16 (uint16), or with meta [E, META_WIDTH] (8-bit layers) the layer's uint8
    blocks -> h += the routed experts' weighted outputs. combine(y, position, weights, h): the MoE block's
    combine (None: launch_moe_combine). wgmma: CudaOptions.wgmma_experts (grouped_tile); w8a8: the layer's
    w8a8_kind with CudaOptions.q8_activations (None: off)."""
    T, K = ids.shape
    E = experts.shape[0]
    n = T * K
    cfg = step_tile(n, E, F, D, experts, meta is not None, wgmma, w8a8)
    bm = cfg.block_m
    tiles = max_tiles(n, E, bm)
    rows = tiles * bm
    sorted_ids, tile_expert, num_tiles = ws.mma_sorted_ids[:rows], ws.mma_tile_expert[:tiles], ws.mma_num_tiles
    xs, hb, out = ws.mma_xs[:rows], ws.mma_h[:rows], ws.moe_out[:n]
    launch_moe_align(ids, E, bm, sorted_ids, tile_expert, num_tiles, ws.position[:n], stream=stream)
    if takes_w8a8(w8a8, cfg, meta is not None):
        q8 = ws.mma_q8_rows
        xq, hq = q8[: rows * D].reshape(rows, D), q8[: rows * F].reshape(rows, F)
        scales = ws.mma_q8_scales[:rows]
        w8a8_experts(
            x,
            sorted_ids,
            tile_expert,
            num_tiles,
            K,
            experts,
            meta,
            w8a8,
            F,
            D,
            xq,
            scales,
            hq,
            scales,
            hb,
            out,
            cfg,
            stream,
        )
    else:
        launch_moe_gather_bf16(x, sorted_ids, num_tiles, K, bm, xs, stream=stream)
        gemms_on_bf16_rows(cfg, xs, hb, out, sorted_ids, tile_expert, num_tiles, experts, meta, F, D, stream)
    if combine is None:
        launch_moe_combine(out, ws.identity_position[:n], weights, h, stream=stream)
    else:
        combine(out, ws.identity_position[:n], weights, h)


def w8a8_experts(
    x,
    sorted_ids,
    tile_expert,
    num_tiles,
    K: int,
    experts,
    meta,
    kind: W8A8Kind,
    F: int,
    D: int,
    xq,
    x_scales,
    hq,
    h_scales,
    h,
    out,
    cfg,
    stream,
) -> None:
    """A W8A8 step's four launches (module docstring): x [T, D] f32 -> xq [rows, D] 8-bit, x_scales [rows] ->
    h [rows, F] bf16 -> hq [rows, F], h_scales [rows] -> out [T*K, D] f32 in assignment order. hq / h_scales may
    share xq's / x_scales' memory (those are read only before these are written). kind: the layer's w8a8_kind;
    cfg: moe_gemm_w8a8.config_for's tile for the step (grouped_tile)."""
    code, block_scaled = kind.code, kind.block_scaled
    bm = cfg.block_m
    launch_quantize_gathered(x, sorted_ids, num_tiles, K, bm, code, xq, x_scales, stream=stream)
    launch_w8a8_gate_up(
        xq, x_scales, tile_expert, num_tiles, experts, meta, code, block_scaled, F, D, h, cfg, stream=stream
    )
    launch_quantize_rows(h, num_tiles, bm, code, hq, h_scales, stream=stream)
    launch_w8a8_down(
        hq,
        h_scales,
        tile_expert,
        num_tiles,
        sorted_ids,
        experts,
        meta,
        code,
        block_scaled,
        F,
        D,
        out,
        cfg,
        stream=stream,
    )


def gemms_on_bf16_rows(
    cfg, xs, hb, out, sorted_ids, tile_expert, num_tiles, experts, meta, F: int, D: int, stream
) -> None:
    """gate|up then down on the gathered bf16 rows xs, on the kernels of cfg (wgmma or mma.sync; 8-bit with meta)."""
    if isinstance(cfg, WgmmaConfig) and meta is None:
        launch_wgmma_gate_up(xs, tile_expert, num_tiles, experts, F, D, hb, config=cfg, stream=stream)
        launch_wgmma_down(hb, tile_expert, num_tiles, sorted_ids, experts, F, D, out, config=cfg, stream=stream)
    elif isinstance(cfg, WgmmaConfig):
        launch_q8wgmma_gate_up(xs, tile_expert, num_tiles, experts, meta, F, D, hb, config=cfg, stream=stream)
        launch_q8wgmma_down(hb, tile_expert, num_tiles, sorted_ids, experts, meta, F, D, out, config=cfg, stream=stream)
    elif meta is None:
        launch_moe_gemm_gate_up(xs, tile_expert, num_tiles, experts, F, D, hb, config=cfg, stream=stream)
        launch_moe_gemm_down(
            hb, tile_expert, num_tiles, sorted_ids, experts, F, D, out, combine=COMBINE_STORE, config=cfg, stream=stream
        )
    else:
        launch_q8mma_gate_up(xs, tile_expert, num_tiles, experts, meta, F, D, hb, config=cfg, stream=stream)
        launch_q8mma_down(hb, tile_expert, num_tiles, sorted_ids, experts, meta, F, D, out, config=cfg, stream=stream)
