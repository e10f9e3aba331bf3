"""The cuda backend's pure host-side logic (no GPU needed): the workspace layout, the MoE strategy choice."""

import numpy as np
import pytest

from common.models import config_from_hf
from expert_service.cuda import moe, moe_strategy
from expert_service.cuda.moe_grouped_mma import grouped_mma_layout
from expert_service.cuda.moe_strategy import (
    ALL_EXPERTS_MAX_TOKENS,
    FUSED_ROUTER_MAX_TOKENS,
    GROUPED_MAX_TOKENS,
    GROUPED_MMA_MIN_EXPERTS,
    WARMUP_TOKENS,
    MoeStrategy,
    choose_strategy,
    fused_router,
    warmup_tokens,
)
from expert_service.cuda.workspace import (
    METADATA,
    PLAN_METADATA,
    RESULTS,
    layout_workspace,
    packed_layout,
    stage_routed_ids,
)
from expert_service.engine.cuda_options import CudaOptions
from expert_service.kernels.greedy_split import parts
from expert_service.kernels.moe_align import MAX_ASSIGNMENTS, MAX_E, max_rows, max_tiles
from expert_service.kernels.moe_gemm_mma import choose_config
from expert_service.tools.tiny_model import tiny_hf_config


def test_packed_layout_is_ordered_aligned_and_disjoint():
    rng = np.random.default_rng()
    shapes = {f"a{i}": tuple(int(n) for n in rng.integers(1, 40, size=rng.integers(1, 3))) for i in range(6)}
    offsets, total = packed_layout(shapes)
    spans = [(offsets[n], offsets[n] + int(np.prod(s))) for n, s in shapes.items()]
    assert [o for o, _ in spans] == sorted(o for o, _ in spans)  # packed in the given order
    assert all(o % 4 == 0 for o, _ in spans)  # 16-byte aligned int32 views
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # disjoint
    assert spans[-1][1] <= total < spans[-1][1] + 4


def test_step_metadata_uploads_as_a_prefix():
    """The step uploads the packed prefix ending in block_tables[:S], so block_tables must come last and
    every packed array must be int32."""
    config = config_from_hf(tiny_hf_config("mixtral"))
    layout = layout_workspace(config, np.dtype(np.uint16), 128, 8, 16, len(config.moe_layers))
    assert METADATA[-1] == "block_tables" and RESULTS[-1] == "topk_ids"
    for name in METADATA + RESULTS:
        assert layout[name][1] == np.int32, name


def test_moe_strategy_by_step_size():
    """One token -> GEMV; up to 64 tokens -> all experts when they reach most experts, else grouped; larger
    -> per-expert cuBLAS; the expert cache -> its grouped or cuBLAS waves; the warm-up reaches each."""
    S = MoeStrategy
    assert choose_strategy(1, 2, 8, cached=False) is S.GEMV
    assert choose_strategy(1, 8, 8, cached=False) is S.ALL_EXPERTS  # K = E: every expert anyway
    assert choose_strategy(2, 2, 8, cached=False) is S.GROUPED
    assert choose_strategy(4, 2, 8, cached=False) is S.ALL_EXPERTS
    assert choose_strategy(ALL_EXPERTS_MAX_TOKENS, 8, 128, cached=False) is S.ALL_EXPERTS
    assert choose_strategy(ALL_EXPERTS_MAX_TOKENS, 1, 128, cached=False) is S.GROUPED
    assert choose_strategy(GROUPED_MAX_TOKENS + 1, 2, 8, cached=False) is S.CUBLAS_PER_EXPERT
    assert choose_strategy(1, 2, 8, cached=True) is S.CACHED_GROUPED
    assert choose_strategy(GROUPED_MAX_TOKENS + 1, 2, 8, cached=True) is S.CACHED_CUBLAS
    assert {choose_strategy(t, 2, 8, cached=False) for t in WARMUP_TOKENS} == {
        S.GEMV,
        S.GROUPED,
        S.ALL_EXPERTS,
        S.CUBLAS_PER_EXPERT,
    }


def test_grouped_mma_strategy_thresholds(monkeypatch):
    """bf16 resident layers with GROUPED_MMA_MIN_EXPERTS..256 experts take GROUPED_MMA at every T >= 2 (one
    token keeps GEMV); fewer experts only while T*K < E (mixtral's decode of 2 or 3); other dtypes and the
    expert cache keep their strategies; the switch turns it off."""
    S = MoeStrategy
    E = GROUPED_MMA_MIN_EXPERTS
    assert E == 32
    for T in (2, 3, 16, 64, 65, 512, 8192):
        assert choose_strategy(T, 8, 128, cached=False, bf16=True) is S.GROUPED_MMA
        assert choose_strategy(T, 2, E, cached=False, bf16=True) is S.GROUPED_MMA
        assert choose_strategy(T, 8, 128, cached=False) is choose_strategy(T, 8, 128, cached=False, bf16=False)
        few = S.GROUPED_MMA if T * 2 < E - 1 else choose_strategy(T, 2, E - 1, cached=False)
        assert choose_strategy(T, 2, E - 1, cached=False, bf16=True) is few
        few = S.GROUPED_MMA if T * 2 < 8 else choose_strategy(T, 2, 8, cached=False)
        assert choose_strategy(T, 2, 8, cached=False, bf16=True) is few
        assert choose_strategy(T, 8, 128, cached=True, bf16=True) in (S.CACHED_GROUPED, S.CACHED_CUBLAS)
    assert choose_strategy(1, 8, 128, cached=False, bf16=True) is S.GEMV
    assert choose_strategy(1, 2, E, cached=False, bf16=True) is S.GEMV
    assert choose_strategy(4, 8, MAX_E, cached=False, bf16=True) is S.GROUPED_MMA
    assert choose_strategy(4, 8, MAX_E + 1, cached=False, bf16=True) is not S.GROUPED_MMA  # moe_align's limit
    assert choose_strategy(MAX_ASSIGNMENTS // 8 + 1, 8, 128, cached=False, bf16=True) is S.CUBLAS_PER_EXPERT
    assert [choose_strategy(T, 2, 8, cached=False, bf16=True) for T in (2, 3, 4)] == [S.GROUPED_MMA] * 2 + [
        S.ALL_EXPERTS
    ]
    assert choose_strategy(3, 2, 8, cached=False, bf16=False) is S.GROUPED  # fp32 / fp16 weights: no mma
    monkeypatch.setattr(moe_strategy, "GROUPED_MMA_MIN_EXPERTS", 1 << 30)
    assert choose_strategy(16, 8, 128, cached=False, bf16=True) is S.ALL_EXPERTS
    assert choose_strategy(512, 8, 128, cached=False, bf16=True) is S.CUBLAS_PER_EXPERT


def test_fused_router_threshold():
    assert FUSED_ROUTER_MAX_TOKENS == 64
    shipped = CudaOptions()
    assert fused_router(1, shipped) and fused_router(64, shipped) and not fused_router(65, shipped)
    assert not fused_router(1, CudaOptions(fused_router=False))


@pytest.mark.parametrize("options", [CudaOptions(), CudaOptions(fused_router=False)])
def test_warmup_reaches_every_strategy_tile_config_and_router(options):
    """Every (strategy, grouped-MMA tile config, router) a step of up to T tokens takes is taken by one of the
    warm-up prefills, so no kernel module loads while serving."""

    def kind(T, K, E, bf16):
        strategy = choose_strategy(T, K, E, cached=False, bf16=bf16)
        tile = choose_config(T * K, E) if strategy is MoeStrategy.GROUPED_MMA else None
        return strategy, tile, fused_router(T, options)

    for K, E, bf16, T in ((8, 128, True, 2048), (4, 40, True, 512), (2, 8, True, 512), (8, 128, False, 512)):
        sizes = warmup_tokens(T, K, E, bf16, options)
        assert set(WARMUP_TOKENS) <= set(sizes)
        assert {kind(t, K, E, bf16) for t in sizes if t <= T} == {kind(t, K, E, bf16) for t in range(1, T + 1)}
    assert {kind(t, 8, 128, True)[0] for t in warmup_tokens(2048, 8, 128, True, options)} == {
        MoeStrategy.GEMV,
        MoeStrategy.GROUPED_MMA,
    }


@pytest.mark.parametrize("wgmma", [True, False])
def test_warmup_and_workspace_cover_the_wgmma_tiles(monkeypatch, wgmma):
    """On an sm_90 device (hopper() patched), qwen3moe-like dims (F, D multiples of 64) take the wgmma tile from 96
    rows an expert: the warm-up reaches it with wgmma_experts on (and only then), at the first such size, and the
    workspace holds its rows and the mma.sync tiles' (more, smaller) tiles whatever the option, since set_options
    switches it without a new workspace."""
    import expert_service.cuda.moe_grouped_mma as grouped
    from expert_service.kernels.moe_gemm_wgmma import CONFIGS as WGMMA

    monkeypatch.setattr(grouped, "hopper", lambda: True)
    K, E, F, D, T = 8, 128, 768, 2048, 2048
    options = CudaOptions(wgmma_experts=wgmma)
    sizes = warmup_tokens(T, K, E, True, options, dims=(F, D))
    first = -(-grouped.WGMMA_MIN_ROWS * E // K)  # the first T with 96 rows an expert
    tiles = {grouped.grouped_tile(t * K, E, F, D, False, wgmma) for t in sizes}
    assert (WGMMA["w128"] in tiles) == wgmma and (first in sizes) == wgmma
    assert grouped.grouped_tile((first - 1) * K, E, F, D, False, True) == choose_config((first - 1) * K, E)
    assert grouped.grouped_tile(first * K, E, F, D, True, True) == WGMMA["w128"]  # 8-bit too
    assert grouped.grouped_tile(first * K, E, F + 8, D, False, True) == choose_config(first * K, E)  # F % 64
    layout = grouped.grouped_mma_layout(T, K, E, D, F)
    need_rows = max(max_rows(t * K, E, bm) for t in range(1, T + 1) for bm in (64, 128))
    need_tiles = max(max_tiles(t * K, E, choose_config(t * K, E).block_m) for t in range(1, T + 1))
    assert layout["mma_sorted_ids"][0][0] >= need_rows and layout["mma_tile_expert"][0][0] >= need_tiles


def test_workspace_holds_what_the_reachable_strategies_need(monkeypatch):
    """A bf16 many-expert model gets the grouped-MMA buffers (sized for the largest tile need of any step) and
    none of the per-assignment / all-experts buffers; with the switch off, the reverse. The fused router's
    counter and greedy_split's partials are there for every model."""
    config = config_from_hf({**tiny_hf_config("qwen3_moe"), "num_experts": 40, "num_experts_per_tok": 8})
    T, S, K, E = 512, 16, 8, 40
    bf16, f32 = np.dtype(np.uint16), np.dtype(np.float32)
    layout = layout_workspace(config, bf16, T, S, 16, len(config.moe_layers))
    rows = max(max_rows(t * K, E, choose_config(t * K, E).block_m) for t in range(1, T + 1))
    tiles = max(max_tiles(t * K, E, choose_config(t * K, E).block_m) for t in range(1, T + 1))
    D, F = config.hidden_size, config.moe_intermediate_size
    assert layout["mma_sorted_ids"][0] == (rows,) and layout["mma_tile_expert"][0] == (tiles,)
    assert layout["mma_xs"] == ((rows, D), bf16) and layout["mma_h"] == ((rows, F), bf16)
    assert layout["mma_num_tiles"][0] == (1,)
    assert not {"moe_in", "moe_up", "all_experts_gate", "all_experts_up", "all_experts_out"} & set(layout)
    assert layout["moe_gate"][0] == (K, F) and layout["moe_out"][0] == (T * K, D)  # GEMV rows; y rows
    assert layout["identity_position"][0] == (T * K,)
    assert layout["cast"][0][0] >= T * max(D, config.q_size)
    assert layout["router_counter"] == ((FUSED_ROUTER_MAX_TOKENS,), np.dtype(np.int32))
    for name in ("greedy_part_values", "greedy_part_ids", "greedy_part_flags"):
        assert layout[name][0] == (S, parts(config.vocab_size))
    assert not {"expert_x", "expert_gate_up", "expert_h"} & set(layout)
    # other dtypes: no grouped MMA, and per-expert cuBLAS above 64 tokens: its rows in the weights' dtype (rounded
    # row counts need slack rows), f32 gate rows only for the grouped kernels' steps (up to 64 tokens)
    other = layout_workspace(config, f32, T, S, 16, len(config.moe_layers))
    rows = T * K + moe.CUBLAS_ROW_SLACK
    assert "mma_xs" not in other and not {"moe_in", "moe_up"} & set(other)
    assert other["expert_x"] == ((rows, D), f32) and other["expert_gate_up"] == ((rows, 2 * F), f32)
    assert other["expert_h"] == ((rows, F), f32) and other["moe_out"][0] == (rows, D)
    assert other["moe_gate"][0] == (moe_strategy.GROUPED_MAX_TOKENS * K, F)
    cached = layout_workspace(config, bf16, T, S, 16, len(config.moe_layers), cached=True)  # the expert cache
    assert "mma_xs" not in cached and cached["moe_in"][0] == (T * K, D) and cached["moe_gate"][0] == (T * K, F)
    assert cached["moe_up"][0] == (T * K, F) and "expert_x" not in cached
    assert cached["cast"][0][0] >= T * K * max(D, config.q_size, F)
    # with the cache's tensor-core waves (CudaOptions.cached_mma): the sorted rows of steps up to the grouped limit
    # and a tile -> slot map as long as the tile list; none for an 8-bit model or float32 weights
    tensor = layout_workspace(config, bf16, T, S, 16, len(config.moe_layers), cached=True, cached_mma=True)
    small = grouped_mma_layout(min(T, moe_strategy.GROUPED_MAX_TOKENS), K, config.num_experts, D, F)
    assert all(tensor[name] == small[name] for name in small) and tensor["mma_tile_slot"] == small["mma_tile_expert"]
    for no in (dict(weight_dtype=bf16, quantized=True), dict(weight_dtype=f32)):
        dtype = no.pop("weight_dtype")
        plain = layout_workspace(config, dtype, T, S, 16, len(config.moe_layers), cached=True, cached_mma=True, **no)
        assert "mma_tile_slot" not in plain and "mma_xs" not in plain
    monkeypatch.setattr(moe_strategy, "GROUPED_MMA_MIN_EXPERTS", 1 << 30)
    monkeypatch.setattr(moe_strategy, "GROUPED_MMA_SPARSE_STEPS", False)
    off = layout_workspace(config, bf16, T, S, 16, len(config.moe_layers))
    assert "mma_xs" not in off and off["expert_gate_up"] == ((rows, 2 * F), bf16) and "all_experts_out" in off
    assert off["expert_x"] == ((rows, D), bf16) and off["expert_h"] == ((rows, F), bf16)
    f16 = np.dtype(np.float16)  # fp16 gate|up could overflow: cuBLAS writes them in float32
    half = layout_workspace(config, f16, T, S, 16, len(config.moe_layers))
    assert half["expert_gate_up"] == ((rows, 2 * F), f32) and half["expert_h"] == ((rows, F), f16)


def test_int8_activation_buffers_are_laid_out_wherever_moe_q8_or_the_cache_gemv_runs():
    """moe_q8's steps (one token by slot, grouped up to GROUPED_MAX_TOKENS) may run on int8 activations under
    CudaOptions.q8_decode_activations, which set_options may turn on at any time: an 8-bit model's workspace
    holds the per-block SwiGLU maxima of its largest such step and the int8 token rows, whatever the options;
    a bf16 model (no moe_q8) holds neither."""
    from expert_service.kernels.moe_q8_dp4a import gate_up_parts

    config = config_from_hf({**tiny_hf_config("mixtral"), "num_local_experts": 8, "num_experts_per_tok": 2})
    K, D, F = 2, config.hidden_size, config.moe_intermediate_size
    u8, f32 = np.dtype(np.uint8), np.dtype(np.float32)
    for T in (1, 40, 512):
        q8 = layout_workspace(config, np.dtype(np.uint16), T, 16, 16, len(config.moe_layers), quantized=True)
        rows = min(T, GROUPED_MAX_TOKENS)
        assert q8["moe_gate_part_max"] == ((max(K, rows * K), gate_up_parts(F)), f32), T
        assert q8["moe_x_q8"] == ((rows, D), u8) and q8["moe_x_scale"] == ((rows,), f32), T
    bf16 = layout_workspace(config, np.dtype(np.uint16), 512, 16, 16, len(config.moe_layers))
    assert not {"moe_gate_part_max", "moe_x_q8", "moe_x_scale"} & set(bf16)
    # the expert cache's one-token steps (CACHED_GEMV) take the maxima of one token's K rows; its grouped waves
    # never run on int8 activations, and a bf16 cache needs neither
    for T in (1, 512):
        cached = layout_workspace(config, np.dtype(np.uint16), T, 16, 16, 4, cached=True, quantized=True)
        assert cached["moe_gate_part_max"] == ((K, gate_up_parts(F)), f32), T
        assert not {"moe_x_q8", "moe_x_scale"} & set(cached), T
        cached_bf16 = layout_workspace(config, np.dtype(np.uint16), T, 16, 16, 4, cached=True)
        assert "moe_gate_part_max" not in cached_bf16, T


# --- routing=lut: the step's plan staged with its metadata ------------------------------------------------
def test_lut_layout_packs_the_plan_after_block_tables():
    """routing=lut adds routed_ids ([MoE layers x T x K] int32) behind block_tables in the packed metadata, so a
    lut step's one upload is the prefix through its plan; exact routing has no such buffer."""
    config = config_from_hf(tiny_hf_config("qwen3_moe"))
    L, T, S, K = len(config.moe_layers), 96, 8, config.num_experts_per_tok
    exact = layout_workspace(config, np.dtype(np.float32), T, S, 16, L)
    lut = layout_workspace(config, np.dtype(np.float32), T, S, 16, L, planned=True)
    assert "routed_ids" not in exact and set(lut) - set(exact) == {"routed_ids"}
    assert lut["routed_ids"] == ((L * T * K,), np.dtype(np.int32)) and PLAN_METADATA == ("routed_ids",)
    offsets, _ = packed_layout({name: lut[name][0] for name in METADATA + PLAN_METADATA})
    tables_end = offsets["block_tables"] + (S + 1) * 16  # a step's sequences and the padding one
    assert offsets["routed_ids"] >= tables_end and offsets["routed_ids"] - tables_end < 4


def test_stage_routed_ids_lays_out_each_layer_as_the_moe_block_reads_it():
    """Layer m of a step of T (padded) tokens is rows m*T*K:(m+1)*T*K (DeviceMoe's view, as topk_ids); real
    tokens carry their plan, padding tokens experts 0..K-1; nothing past the step's part is written."""
    rng = np.random.default_rng()
    layers, n, padded, K, E = [1, 3, 4], 5, 8, 3, 9
    routed = {layer: np.stack([rng.choice(E, K, replace=False) for _ in range(n)]) for layer in layers}
    flat = np.full(len(layers) * 16 * K, -7, np.int32)
    count = stage_routed_ids(flat, routed, layers, n, padded, K)
    assert count == len(layers) * padded * K
    assert (flat[count:] == -7).all()
    n_step = padded * K
    for m, layer in enumerate(layers):
        ids = flat[m * n_step : (m + 1) * n_step].reshape(padded, K)
        np.testing.assert_array_equal(ids[:n], routed[layer])
        np.testing.assert_array_equal(ids[n:], np.tile(np.arange(K), (padded - n, 1)))


def test_stage_routed_ids_without_a_plan_and_with_a_bad_one():
    """Steps the worker makes itself (warm-up, graph capture) have no plan: every token gets experts 0..K-1. A
    plan missing a layer or of the wrong shape is refused naming the layer (the engine checks plans before)."""
    flat = np.full(2 * 4 * 2, -7, np.int32)
    assert stage_routed_ids(flat, None, [0, 1], 3, 4, 2) == 16
    np.testing.assert_array_equal(flat.reshape(2, 4, 2), np.tile(np.arange(2), (2, 4, 1)))
    with pytest.raises(ValueError, match="layer 1"):
        stage_routed_ids(flat, {0: np.zeros((3, 2), np.int64)}, [0, 1], 3, 4, 2)
    with pytest.raises(ValueError, match=r"layer 0 has shape \[3, 1\]"):
        stage_routed_ids(flat, {0: np.zeros((3, 1), np.int64), 1: np.zeros((3, 2), np.int64)}, [0, 1], 3, 4, 2)


def test_decode_split_views_fit_every_step_size():
    """The split-K workspace holds S * decode_split_count(S) rows for every decode step size S, so one sequence
    gets its own (many) parts and the largest batch its few; the views are [S, H, P, Hd] and [S, H, P, 2]."""
    from types import SimpleNamespace

    from expert_service.cuda.workspace import decode_split_count, decode_split_views

    config = config_from_hf({**tiny_hf_config("qwen3_moe"), "max_position_embeddings": 32768})
    H, Hd, S = config.num_attention_heads, config.head_dim, 64
    layout = layout_workspace(config, np.dtype(np.uint16), 512, S, 16, len(config.moe_layers))
    rows = layout["split_out"][0][0]
    assert layout["split_out"][0] == (rows, H, Hd) and layout["split_ml"][0] == (rows, H, 2)
    counts = {s: decode_split_count(config, s) for s in range(1, S + 1)}
    assert counts[1] > counts[S] >= 1 and rows == max(s * p for s, p in counts.items())
    ws = SimpleNamespace(split_out=np.arange(rows * H * Hd, dtype=np.float32).reshape(rows, H, Hd))
    ws.split_ml = np.zeros((rows, H, 2), np.float32)
    for s in (1, 7, S):
        part_out, part_ml = decode_split_views(ws, config, s, counts[s])
        assert part_out.shape == (s, H, counts[s], Hd) and part_ml.shape == (s, H, counts[s], 2)
        assert part_out.base is not None and part_out.reshape(-1)[0] == 0  # a view from the buffer's start
    assert decode_split_views(ws, config, 1, counts[S])[0].shape == (1, H, counts[S], Hd)  # the option off
