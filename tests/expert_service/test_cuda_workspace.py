"""The cuda backend's memory plan: pure layout logic (no GPU needed)."""
import numpy as np

from common.models import config_from_hf
from expert_service.tiny_model import tiny_hf_config
from expert_service.cuda.workspace import METADATA, RESULTS, packed_layout, plan_workspace


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
    plan = plan_workspace(config, np.dtype(np.uint16), 128, 8, 16, len(config.moe_layers))
    assert METADATA[-1] == "block_tables" and RESULTS[-1] == "topk_ids"
    for name in METADATA + RESULTS:
        assert plan[name][1] == np.int32, name
