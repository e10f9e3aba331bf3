"""The worker's device memory plan: every buffer a step touches, allocated once at start-up.

Steps only take views (``buf[:T]``) of these arrays, so nothing is allocated on the device while serving
(tests count it). Sizes follow the engine limits: T = max_batch_tokens, S = max_batch_size. The MoE buffers
follow the strategies steps of up to T tokens can take (`moe_strategy.reachable_strategies`): a bf16 model with many
experts runs GROUPED_MMA at every T >= 2 and needs neither the per-assignment f32 rows of the grouped kernels
and the expert cache, nor per-expert cuBLAS's rows in the weights' dtype, nor the all-experts buffers, but its
bf16 sorted rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from cuda.bindings import driver as drv
from numba import cuda

from common.model_config import ModelConfig
from expert_service.cuda.cublas import WORKSPACE_BYTES
from expert_service.cuda.dequant_pipeline import HALVES
from expert_service.cuda.driver import check, device_address
from expert_service.cuda.moe import CUBLAS_ROW_SLACK, dequant_group
from expert_service.cuda.moe_grouped_mma import cached_mma_possible, grouped_mma_layout
from expert_service.cuda.moe_strategy import (
    ALL_EXPERTS_MAX_TOKENS,
    FUSED_ROUTER_MAX_TOKENS,
    GROUPED_MAX_TOKENS,
    MoeStrategy,
    reachable_strategies,
)
from expert_service.kernels.attention_decode import MIN_PART_KEYS, TARGET_BLOCKS, decode_splits
from expert_service.kernels.greedy_split import parts as greedy_parts
from expert_service.kernels.moe_q8_dp4a import gate_up_parts

if TYPE_CHECKING:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray


@dataclass
class Workspace:
    arrays: dict[str, DeviceNDArray] = field(default_factory=dict)
    host: dict[str, np.ndarray] = field(default_factory=dict)  # pinned host views (metadata, readbacks)
    metadata: PackedBuffer | None = None
    results: PackedBuffer | None = None

    def select_twin(self, twin: int) -> None:
        """The host copy of the step metadata and results the next step stages into and reads back to."""
        # allocate_workspace makes both; only the kernel tests' bare workspaces lack them, and stage no steps
        assert self.metadata is not None and self.results is not None, "a workspace without packed buffers"
        for buffer in (self.metadata, self.results):
            buffer.select(twin)
            self.host.update(buffer.host_views)

    def __getattr__(self, name):
        try:
            return self.__dict__["arrays"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def nbytes(self) -> int:
        packed = set(METADATA + SHARE_METADATA + PLAN_METADATA + RESULTS)
        return sum(a.nbytes for n, a in self.arrays.items() if n not in packed) + sum(
            b.nbytes for b in (self.metadata, self.results) if b is not None
        )


def decode_split_count(config: ModelConfig, num_seqs: int) -> int:
    """The split-K parts P a decode step of num_seqs sequences gives its attention (attention_decode.decode_splits:
    about TARGET_BLOCKS blocks for the longest context the model allows; each sequence uses as many as its own
    context needs)."""
    return decode_splits(
        num_seqs, config.num_attention_heads, config.num_key_value_heads, config.max_position_embeddings
    )


def decode_split_views(ws, config: ModelConfig, num_seqs: int, splits: int):
    """(part_out [S, H, P, Hd], part_ml [S, H, P, 2]): the split-K workspaces of a decode step of S sequences in P =
    splits parts, views of the workspace's split_out / split_ml (laid out for S * decode_split_count(S) rows at
    every S up to max_seqs, so any P up to that count fits)."""
    S, H, P = num_seqs, config.num_attention_heads, splits
    part_out = ws.split_out.reshape(-1)[: S * H * P * config.head_dim].reshape(S, H, P, config.head_dim)
    return part_out, ws.split_ml.reshape(-1)[: S * H * P * 2].reshape(S, H, P, 2)


def shared_split_count(config: ModelConfig, num_seqs: int, members: int) -> int:
    """The split-K parts PS of a decode step's shared prefixes (attention_decode_shared): about TARGET_BLOCKS blocks
    when its num_seqs sequences make groups of `members` (a group's prefix is read by Hkv x PS blocks)."""
    leaders = -(-num_seqs // members) * config.num_key_value_heads
    return max(1, min(-(-TARGET_BLOCKS // leaders), config.max_position_embeddings // MIN_PART_KEYS))


def shared_split_views(ws, config: ModelConfig, num_seqs: int, splits: int):
    """(shared_out [S, H, PS, Hd], shared_ml [S, H, PS, 2]): the shared prefixes' partials of a decode step of S
    sequences in PS = splits parts, views of the workspace's prefix_part_out / prefix_part_ml (laid out for every S;
    not shared_out, the shared expert's output)."""
    S, H, P = num_seqs, config.num_attention_heads, splits
    out = ws.prefix_part_out.reshape(-1)[: S * H * P * config.head_dim].reshape(S, H, P, config.head_dim)
    return out, ws.prefix_part_ml.reshape(-1)[: S * H * P * 2].reshape(S, H, P, 2)


def layout_workspace(
    config: ModelConfig,
    weight_dtype: np.dtype,
    max_tokens: int,
    max_seqs: int,
    max_blocks_per_seq: int,
    num_layers_moe: int,
    cached: bool = False,
    planned: bool = False,
    quantized: bool = False,
    q8_mma: tuple[int, int] | None = None,
    cached_mma: bool = False,
    cached_grouped: int = GROUPED_MAX_TOKENS,
    few_expert_mma: int = 0,
    w8a8_min_rows: int = 0,
    shared_members: int = 0,
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Name -> (shape, dtype) of every step buffer; pure, so the layout can be printed before allocating.
    cached: the expert cache runs (CachedExperts). planned: routing=lut (each step's plan staged as routed_ids).
    quantized: 8-bit or mixed experts (DeviceWeights.quantized); q8_mma: the step sizes taking Q8_MMA
    (moe_strategy.q8_mma_tokens); cached_mma: the cache's waves may run on the tensor-core kernel (CudaOptions.cached_mma);
    cached_grouped: the largest cached step in grouped waves (moe_strategy.cached_grouped_tokens); few_expert_mma:
    the largest step of a few-expert bf16 layer on GROUPED_MMA (moe_strategy.few_expert_mma_tokens); w8a8_min_rows:
    CudaOptions.w8a8_min_rows with q8_activations on, else 0 (the 8-bit rows of W8A8 steps, on 8-bit models that
    reach Q8_MMA). shared_members: the sequences a group of attention_decode_shared holds at most (0: decode steps
    never share prefixes; CudaOptions.shared_prefix_attention)."""
    T, S, D = max_tokens, max_seqs, config.hidden_size
    K, E, F = config.num_experts_per_tok, config.num_experts, config.moe_intermediate_size
    f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
    dense_ffn = config.intermediate_size if not all(config.sparse_layers) else 0
    shared_ffn = config.shared_expert_intermediate_size
    split_rows = max(s * decode_split_count(config, s) for s in range(1, S + 1))  # every decode step's [s, H, P]
    widest = max(D, config.q_size, F, dense_ffn, shared_ffn)
    strategies = reachable_strategies(
        T,
        K,
        E,
        cached,
        np.dtype(weight_dtype) == np.uint16,
        quantized,
        q8_mma,
        cached_grouped=cached_grouped,
        few_expert_mma=few_expert_mma,
    )
    # f32 gate (grouped kernels, GEMV, the expert cache), inputs and up (the expert cache) per assignment
    cache_rows = T * K if strategies & {MoeStrategy.CACHED_GROUPED, MoeStrategy.CACHED_CUBLAS} else 0
    grouped_rows = min(T, GROUPED_MAX_TOKENS) * K if strategies & {MoeStrategy.GROUPED, MoeStrategy.Q8} else 0
    # per-expert cuBLAS: inputs and SwiGLU rows in the weights' dtype, gate|up too for bf16; it rounds each
    # expert's rows up (moe.cublas_rows), past the step's last one by up to CUBLAS_ROW_SLACK
    per_expert_rows = T * K + CUBLAS_ROW_SLACK if MoeStrategy.CUBLAS_PER_EXPERT in strategies else 0
    # the all-experts strategy of decode steps (cuda/moe.py)
    all_experts_tokens = min(ALL_EXPERTS_MAX_TOKENS, T) if MoeStrategy.ALL_EXPERTS in strategies else 0
    layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {
        "hidden": ((T, D), f32),
        "normed": ((T, D), f32),
        # a step's q [T, q_size], k and v [T, kv_size] back to back (model.qkv_views): at one token the three
        # are one row, written by one GEMV over the layer's q|k|v weight rows
        "qkv": ((T * (config.q_size + 2 * config.kv_size),), f32),
        "attn": ((T, config.q_size), f32),
        "router_logits": ((T, E), f32),
        "topk_ids": ((max(num_layers_moe, 1), T, K), i32),
        "topk_weights": ((T, K), f32),
        "router_counter": ((max(1, min(T, FUSED_ROUTER_MAX_TOKENS)),), i32),  # gate_fused's tickets (zeroed)
        "identity_position": ((T * K,), i32),  # y rows in assignment order (gemv and grouped-MMA combine)
        "counts": ((E,), i32),
        "offsets": ((E + 1,), i32),
        "order": ((T * K,), i32),
        "position": ((T * K,), i32),
        "moe_gate": ((max(K, cache_rows, grouped_rows), F), f32),
        "moe_out": ((max(T * K, per_expert_rows), D), f32),
        "split_out": ((split_rows, config.num_attention_heads, config.head_dim), f32),
        "split_ml": ((split_rows, config.num_attention_heads, 2), f32),
        "last_hidden": ((S, D), f32),
        "logits": ((S, config.vocab_size), f32),
        "greedy_ids": ((S,), i32),
        "nonfinite": ((S,), i32),
        # greedy_split's partials per pass-1 block of each logits row
        "greedy_part_values": ((S, greedy_parts(config.vocab_size)), f32),
        "greedy_part_ids": ((S, greedy_parts(config.vocab_size)), i32),
        "greedy_part_flags": ((S, greedy_parts(config.vocab_size)), i32),
        "token_ids": ((T,), i32),
        "positions": ((T,), i32),
        "slot_mapping": ((T,), i32),
        # per token: the row of greedy_ids (the step before's argmax, still on the device) that is its input
        # token, or -1 (token_ids holds it): a step launched before the one ahead of it was collected
        "feed_rows": ((T,), i32),
        # one sequence slot more than a step holds: a captured prefill pads its tokens with a sequence of its own
        "seq_starts": ((S + 2,), i32),
        "context_lens": ((S + 1,), i32),
        "logits_rows": ((S,), i32),
        "block_tables": ((S + 1, max_blocks_per_seq), i32),
        "cublas_workspace": ((WORKSPACE_BYTES,), np.dtype(np.uint8)),
    }
    if cache_rows:
        layout["moe_up"] = ((cache_rows, F), f32)
        layout["moe_in"] = ((cache_rows, D), f32)
    if per_expert_rows:
        wd = np.dtype(weight_dtype)
        layout["expert_x"] = ((per_expert_rows, D), wd)
        # cuBLAS writes gate|up in bf16 (float32's range) for bf16 weights; fp16 could overflow, so float32
        layout["expert_gate_up"] = ((per_expert_rows, 2 * F), wd if wd == np.uint16 else f32)
        layout["expert_h"] = ((per_expert_rows, F), wd)
        if quantized:  # dense copies of a group of active 8-bit experts for their GEMMs
            layout["dequant"] = ((HALVES * dequant_group(E, F, D, wd.itemsize), 3 * F * D), wd)
    if MoeStrategy.Q8 in strategies:  # moe_q8 steps on int8 activations: the largest |h| of each gate/up block,
        # and the grouped steps' int8 token rows
        layout["moe_gate_part_max"] = ((max(K, grouped_rows), gate_up_parts(F)), f32)
        layout["moe_x_q8"] = ((min(T, GROUPED_MAX_TOKENS), D), np.dtype(np.uint8))
        layout["moe_x_scale"] = ((min(T, GROUPED_MAX_TOKENS),), f32)
    elif quantized and cached:  # the expert cache's one-token steps on int8 activations (CACHED_GEMV)
        layout["moe_gate_part_max"] = ((K, gate_up_parts(F)), f32)
    if all_experts_tokens:
        layout["all_experts_gate"] = ((E * all_experts_tokens * F,), f32)
        layout["all_experts_up"] = ((E * all_experts_tokens * F,), f32)
        layout["all_experts_out"] = ((E, all_experts_tokens, D), f32)
    if strategies & {MoeStrategy.GROUPED_MMA, MoeStrategy.Q8_MMA}:  # the same sorted bf16 rows
        layout.update(grouped_mma_layout(T, K, E, D, F, w8a8_min_rows if MoeStrategy.Q8_MMA in strategies else 0))
    elif cached and cached_mma and cached_mma_possible(weight_dtype, quantized, E, q8_mma is not None):
        # the cache's waves on tensor cores
        grouped = grouped_mma_layout(min(T, cached_grouped), K, E, D, F)
        layout.update(grouped, mma_tile_slot=grouped["mma_tile_expert"])
    if planned:  # the step's plan, [MoE layers, T_step, K] at the front of it (stage_routed_ids)
        layout["routed_ids"] = ((max(num_layers_moe, 1) * T * K,), i32)
    if weight_dtype != np.float32:  # cuBLAS takes activations in the weights' 16-bit type
        # rows of the dense layers, router, shared expert and head; the expert cache's rows; all experts' h
        dense_rows = max(T, S) * max(D, config.q_size, dense_ffn, shared_ffn)
        layout["cast"] = ((max(dense_rows, cache_rows * widest, E * all_experts_tokens * F),), weight_dtype)
    if shared_members:  # the step's groups (staged with its metadata) and their prefixes' partials
        shared_rows = max(s * shared_split_count(config, s, shared_members) for s in range(1, S + 1))
        layout["prefix_part_out"] = ((shared_rows, config.num_attention_heads, config.head_dim), f32)
        layout["prefix_part_ml"] = ((shared_rows, config.num_attention_heads, 2), f32)
        layout["share_starts"] = ((S + 1,), i32)
        layout["share_members"] = ((S + 1, shared_members), i32)
    if dense_ffn:
        layout["dense_gate"] = ((T, dense_ffn), f32)
        layout["dense_up"] = ((T, dense_ffn), f32)
    if shared_ffn:
        layout["shared_gate"] = ((T, shared_ffn), f32)
        layout["shared_up"] = ((T, shared_ffn), f32)
        layout["shared_out"] = ((T, D), f32)
        layout["shared_logit"] = ((T, 1), f32)
    return layout


# Step metadata the host writes, uploaded with one copy: packed int32 in this order (block_tables last, so
# a step uploads a prefix of the packed buffer).
METADATA = (
    "token_ids",
    "positions",
    "slot_mapping",
    "seq_starts",
    "context_lens",
    "logits_rows",
    "feed_rows",
    "block_tables",
)
# With shared_prefix_attention the step's groups go before block_tables (so the prefix a step uploads holds them).
SHARE_METADATA = ("share_starts", "share_members")
# With routing=lut the step's routing plan follows (same packed buffer: a lut step uploads the prefix through its
# plan, the whole block_tables array riding along, or two copies when that array's unused rows are long).
PLAN_METADATA = ("routed_ids",)
# Per-step results the host reads back with one copy (a prefix: the MoE top-k ids only when traced).
RESULTS = ("greedy_ids", "nonfinite", "topk_ids")
# Other buffers with pinned host twins, so their copies are asynchronous.
READBACK = ("logits", "offsets")
# Host copies of METADATA and RESULTS: a step may be launched while the one before it runs, so each takes the
# other copy (the one two steps back was collected: its upload and readback are done).
HOST_TWINS = 2


def packed_layout(shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, int], int]:
    """(element offset of each array, total elements) for int32 arrays packed in order, each starting
    16-byte aligned (the kernels' vector loads and the driver copies want aligned views)."""
    offsets, total = {}, 0
    for name, shape in shapes.items():
        offsets[name] = total
        total += -(-int(np.prod(shape)) // 4) * 4
    return offsets, total


class PackedBuffer:
    """int32 arrays packed into one device buffer with pinned host twins at the same offsets: the host fills
    its views, then one driver copy of a prefix moves them (each Numba copy costs tens of µs of host time).
    `select(i)` makes host twin i the one views, uploads and downloads use."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], stream, twins: int = HOST_TWINS):
        self.offsets, total = packed_layout(shapes)
        self.device = cuda.device_array(max(total, 1), np.int32, stream=stream)
        self.device_views = {
            n: self.device[o : o + int(np.prod(s))].reshape(s)
            for (n, s), o in zip(shapes.items(), self.offsets.values())
        }
        self.twins = [cuda.pinned_array(max(total, 1), np.int32) for _ in range(twins)]
        self.twin_views = [
            {n: host[o : o + int(np.prod(s))].reshape(s) for (n, s), o in zip(shapes.items(), self.offsets.values())}
            for host in self.twins
        ]
        self._device_ptr = device_address(self.device)
        self.select(0)

    def select(self, twin: int) -> None:
        self.host, self.host_views = self.twins[twin], self.twin_views[twin]
        self._host_ptr = self.host.ctypes.data

    def end_of(self, name: str, elements: int) -> int:
        """Elements of the packed prefix that ends after `elements` of array `name`."""
        return self.offsets[name] + elements

    def upload(self, elements: int, stream_handle, start: int = 0) -> None:
        """Copies `elements` int32s from element `start` of the host twin to the device (a prefix by default)."""
        check(
            drv.cuMemcpyHtoDAsync(self._device_ptr + 4 * start, self._host_ptr + 4 * start, 4 * elements, stream_handle)
        )

    def download(self, elements: int, stream_handle) -> None:
        check(drv.cuMemcpyDtoHAsync(self._host_ptr, self._device_ptr, 4 * elements, stream_handle))

    @property
    def nbytes(self) -> int:
        return self.device.nbytes


def allocate_workspace(layout: dict[str, tuple[tuple[int, ...], np.dtype]], stream) -> Workspace:
    ws = Workspace()

    def packed(names):
        assert all(layout[name][1] == np.int32 for name in names), "packed buffers hold int32 arrays"
        buffer = PackedBuffer({name: layout[name][0] for name in names}, stream)
        ws.arrays.update(buffer.device_views)
        ws.host.update(buffer.host_views)
        return buffer

    shared = tuple(n for n in SHARE_METADATA if n in layout)
    ws.metadata = packed(METADATA[:-1] + shared + METADATA[-1:] + tuple(n for n in PLAN_METADATA if n in layout))
    ws.results = packed(RESULTS)
    for name, (shape, dtype) in layout.items():
        if name not in ws.arrays:
            ws.arrays[name] = cuda.device_array(shape, dtype=dtype, stream=stream)
    for name in READBACK:
        shape, dtype = layout[name]
        ws.host[name] = cuda.pinned_array(shape, dtype=dtype)
    return ws


def stage_routed_ids(
    flat: np.ndarray, routed: dict[int, np.ndarray] | None, moe_layers, num_tokens: int, padded: int, top_k: int
) -> int:
    """Writes a step's routing plan into the packed staging `flat` (the routed_ids view) as int32
    [MoE layers, padded, top_k], layer-major like workspace.topk_ids, so MoE layer m of a step of T tokens reads
    rows m*T*K:(m+1)*T*K. routed: {layer: expert ids [num_tokens, top_k]} (routing=lut), or None for steps the
    worker makes itself (warm-up, padding-only graph captures). Padding tokens num_tokens..padded, and every token
    without a plan, go to experts 0..top_k-1 (valid and distinct: the kernels never index out of range). Returns
    the elements written."""
    count = len(moe_layers) * padded * top_k
    ids = flat[:count].reshape(len(moe_layers), padded, top_k)
    ids[:] = np.arange(top_k, dtype=np.int32)
    if routed is not None:
        for m, layer in enumerate(moe_layers):
            plan = routed.get(layer)
            if plan is None:
                raise ValueError(f"routing plan: no expert ids for MoE layer {layer}")
            if plan.shape != (num_tokens, top_k):
                raise ValueError(
                    f"routing plan: layer {layer} has shape {list(plan.shape)}, expected [{num_tokens}, {top_k}]"
                )
            ids[m, :num_tokens] = plan
    return count
