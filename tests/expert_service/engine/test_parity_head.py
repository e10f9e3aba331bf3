"""An 8-bit LM head on the cpu backend against transformers running the same dequantised weights in fp32.

Each case converts a tiny fp32 checkpoint (tied or not) with an int8 or fp8 head, and 8-bit experts in some; the
reference is the HF model, untied, whose lm_head (and 8-bit experts) are what the Colibri directory dequantises to
(q * scale): an error in the head's layout, scale or dequantisation, or a tied model reading its embedding for the
logits, shows.
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

HEAD_CASES = {  # name -> (CASES key, tied, head dtype, expert dtype)
    "mixtral-int8": ("mixtral-gqa-k2", False, "int8", "int8"),
    "qwen3_moe-tied-fp8": ("qwen3_moe-k4", True, "fp8", "fp8"),
    "olmoe-tied-int8": ("olmoe-clip", True, "int8", None),
    "qwen2_moe-fp8": ("qwen2_moe-shared", False, "fp8", "int8"),
}


@pytest.fixture(scope="module", params=sorted(HEAD_CASES))
def case(request, tmp_path_factory):
    base, tied, head_dtype, expert_dtype = HEAD_CASES[request.param]
    family, overrides = CASES[base]
    tmp = tmp_path_factory.mktemp(request.param)
    make_hf_model(family, {**overrides, "tie_word_embeddings": tied}, seed=13).save_pretrained(tmp / "hf")
    model = ModelDir.open(
        convert(tmp / "hf", tmp / "model", progress=False, expert_dtype=expert_dtype, head_dtype=head_dtype)
    )
    assert model.head_format is not None and model.config.tie_word_embeddings is tied
    tensors = {k: v for k, v in load_file(tmp / "hf" / "model.safetensors").items() if k != "lm_head.weight"}
    for spec in tensor_specs(model.config):
        if spec.expert is not None:
            tensors[spec.hf_name] = model.tensor_f32(spec.name)
    tensors["lm_head.weight"] = model.tensor_f32("lm_head")
    hf_config = json.loads((tmp / "hf" / "config.json").read_text())
    return (request.param, *reference_and_engine(model, tmp, tensors, {**hf_config, "tie_word_embeddings": False}))


def test_prefill_logits_match_the_dequantised_reference(case):
    check_prefill_logits(case, 100)


def test_greedy_generation_matches_the_dequantised_reference(case):
    check_greedy_tokens(case, 7)
