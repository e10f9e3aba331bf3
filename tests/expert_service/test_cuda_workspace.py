"""The cuda backend's pure host-side logic (no GPU needed): the workspace layout, the MoE strategy choice."""
import numpy as np

from common.models import config_from_hf
from expert_service.tiny_model import tiny_hf_config
from expert_service.cuda.moe import (ALL_EXPERTS_MAX_TOKENS, GROUPED_MAX_TOKENS, WARMUP_TOKENS, MoeStrategy,
                                     choose_strategy)
from expert_service.cuda.workspace import METADATA, RESULTS, layout_workspace, packed_layout


def test_packed_layout_is_ordered_aligned_and_disjoint():
    rng = np.random.default_rng()
    shapes = {f"a{i}": tuple(int(n) for n in rng.integers(1, 40, size=rng.integers(1, 3))) for i in range(6)}
    offsets, total = packed_layout(shapes)
    spans = [(offsets[n], offsets[n] + int(np.prod(s))) for n, s in shapes.items()]
    assert [o for o, _ in spans] == sorted(o for o, _ in spans)            # packed in the given order
    assert all(o % 4 == 0 for o, _ in spans)                                # 16-byte aligned int32 views
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
    assert choose_strategy(1, 8, 8, cached=False) is S.ALL_EXPERTS          # K = E: every expert anyway
    assert choose_strategy(2, 2, 8, cached=False) is S.GROUPED
    assert choose_strategy(4, 2, 8, cached=False) is S.ALL_EXPERTS
    assert choose_strategy(ALL_EXPERTS_MAX_TOKENS, 8, 128, cached=False) is S.ALL_EXPERTS
    assert choose_strategy(ALL_EXPERTS_MAX_TOKENS, 1, 128, cached=False) is S.GROUPED
    assert choose_strategy(GROUPED_MAX_TOKENS + 1, 2, 8, cached=False) is S.CUBLAS_PER_EXPERT
    assert choose_strategy(1, 2, 8, cached=True) is S.CACHED_GROUPED
    assert choose_strategy(GROUPED_MAX_TOKENS + 1, 2, 8, cached=True) is S.CACHED_CUBLAS
    assert {choose_strategy(t, 2, 8, cached=False) for t in WARMUP_TOKENS} == {
        S.GEMV, S.GROUPED, S.ALL_EXPERTS, S.CUBLAS_PER_EXPERT}
