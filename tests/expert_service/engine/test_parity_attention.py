"""8-bit attention projections on the cpu backend against transformers running the same dequantised weights in fp32.

Each case converts a tiny fp32 checkpoint with int8 or fp8 projections (and 8-bit experts or head in some); the
reference is the HF model whose projections (and 8-bit experts and head) are what the Colibri directory dequantises
to (q * scale): an error in the stacked layout, a scale or the dequantisation shows, in every family (q/k/v biases,
q/k norms, clipped qkv).
"""

from __future__ import annotations

import json

import pytest
from safetensors.numpy import load_file

from common.model_format import ModelDir
from common.models import tensor_specs
from expert_service.tools.convert import convert
from tests.expert_service.engine.dequantised_parity import (
    check_greedy_tokens,
    check_prefill_logits,
    reference_and_engine,
)
from tests.hf_reference import CASES, make_hf_model

# name -> (CASES key, overrides making hidden_size a multiple of 64, attention dtype, expert dtype, head dtype)
ATTENTION_CASES = {
    "mixtral-int8": ("mixtral-gqa-k2", dict(hidden_size=128, num_attention_heads=4), "int8", "int8", None),
    "qwen3_moe-fp8": ("qwen3_moe-k4", {}, "fp8", "fp8", "fp8"),
    "olmoe-int8": ("olmoe-clip", {}, "int8", None, "int8"),
    "qwen2_moe-fp8": ("qwen2_moe-shared", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4), "fp8",
                      "int8", None),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(ATTENTION_CASES))
def case(request, tmp_path_factory):
    base, sizes, attention_dtype, expert_dtype, head_dtype = ATTENTION_CASES[request.param]
    family, overrides = CASES[base]
    tmp = tmp_path_factory.mktemp(request.param)
    make_hf_model(family, {**overrides, **sizes}, seed=17).save_pretrained(tmp / "hf")
    model = ModelDir.open(
        convert(
            tmp / "hf", tmp / "model", progress=False, expert_dtype=expert_dtype, head_dtype=head_dtype,
            attention_dtype=attention_dtype,
        )
    )  # fmt: skip
    assert model.attention_format is not None
    tensors = load_file(tmp / "hf" / "model.safetensors")
    for spec in tensor_specs(model.config):
        if spec.name in model.entries and model.entries[spec.name].dtype in ("int8", "float8_e4m3fn"):
            tensors[spec.hf_name] = model.tensor_f32(spec.name)
    hf_config = json.loads((tmp / "hf" / "config.json").read_text())
    assert not hf_config.get("tie_word_embeddings")
    return (request.param, *reference_and_engine(model, tmp, tensors, hf_config))


def test_prefill_logits_match_the_dequantised_reference(case):
    check_prefill_logits(case, 200)


def test_greedy_generation_matches_the_dequantised_reference(case):
    check_greedy_tokens(case, 9)
