"""8-bit weight streams with the block layout given at launch (CudaOptions.q8_layout_at_launch) against each
launch reading its meta row on the device (the option off): the same bits on one engine (set_options between them),
for experts by slot, grouped and through the expert cache's slots, the 8-bit LM head and attention projections
(GPU only; the simulator tests of moe_q8 and linear_q8 check the kernels themselves)."""

import pytest
from numba import cuda

from expert_service.engine.cuda_options import CudaOptions
from tests.expert_service.cuda.test_fusions import assert_bitwise, open_engine, run_steps
from tests.expert_service.cuda.test_programmatic import one_sequence
from tests.expert_service.cuda.test_quantized import quantized_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda.is_available(), reason="needs a GPU")]

# (experts, attention projections): "mixed" has uniform int8 layers and one of several encodings (meta read there)
VARIANTS = [("int8", "int8"), ("fp8-block128", "fp8"), ("mixed", None)]


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: v[0])
def eight_bit_model(request, tmp_path_factory):
    experts, attention = request.param
    root = tmp_path_factory.mktemp(experts)
    return experts, quantized_model(root, "qwen3_moe", experts, dense="bfloat16", head="int8", attention=attention)


@pytest.mark.parametrize("cache_slots", [0, 3])  # 3 of the tiny model's 4 experts a layer
def test_layout_given_equals_meta_read_bit_for_bit(eight_bit_model, cache_slots):
    name, path = eight_bit_model
    engine = open_engine(path, expert_cache_slots=cache_slots) if cache_slots else open_engine(path)
    moe, layouts = engine.decoder.model.moe, engine.decoder.weights.expert_layout
    shared = [layout is not None for layout in layouts.values()]
    assert all(shared) if name != "mixed" else any(shared) and not all(shared), (name, shared)
    model = engine.decoder.model
    runners = [model.head_8bit[1], model.attention_8bit.rows] if model.attention_8bit else [model.head_8bit[1]]
    first = next(iter(layouts))  # the first MoE layer is shared in every variant

    def reached(on: bool) -> bool:  # the option reached every 8-bit launcher: experts, head, attention
        return (moe.layout(first) is not None) is on and all(r.layout_at_launch is on for r in runners)

    assert reached(True), "on by default"
    engine.decoder.set_options(CudaOptions(q8_layout_at_launch=False))
    assert reached(False)
    read = one_sequence(engine, decodes=6), run_steps(engine)
    engine.decoder.set_options(CudaOptions())
    assert reached(True)
    given = one_sequence(engine, decodes=6), run_steps(engine)
    for what, a, b in zip(("one sequence", "ragged batch"), given, read):
        assert_bitwise(a, b, f"{name}, {cache_slots} cache slots, {what}: layout given vs meta read")
