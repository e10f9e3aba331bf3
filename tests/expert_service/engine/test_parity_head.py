"""An 8-bit LM head on the cpu backend against transformers running the same dequantised weights in fp32.

Each case converts a tiny fp32 checkpoint (tied or not) with an int8 or fp8 head, and 8-bit experts in some; the
reference is the HF model, untied, whose lm_head (and 8-bit experts) are what the Colibri directory dequantises to
(q * scale): an error in the head's layout, scale or dequantisation, or a tied model reading its embedding for the
logits, shows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from common.model_format import ModelDir
from common.models import tensor_specs
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.tools.convert import convert
from tests.helpers import rel_error
from tests.hf_reference import CASES, hf_greedy, hf_logits, make_hf_model

TOLERANCE = 1e-4
VOCAB = 211
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
    (tmp / "ref").mkdir()
    save_file(tensors, str(tmp / "ref" / "model.safetensors"), metadata={"format": "pt"})
    hf_config = json.loads((tmp / "hf" / "config.json").read_text())
    (tmp / "ref" / "config.json").write_text(json.dumps({**hf_config, "tie_word_embeddings": False}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp / "ref", dtype="float32").eval()
    ref.config._attn_implementation = "eager"
    engine = build_engine(model, EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=1024))
    return request.param, ref, engine


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def test_prefill_logits_match_the_dequantised_reference(case):
    name, ref, engine = case
    for n in (1, 8, 19):
        ids = prompt(100 + n, n)
        err = rel_error(engine.prompt_logits(ids), hf_logits(ref, ids))
        assert err <= TOLERANCE, f"{name}: prefill of {n}: relative error {err:.2e}"


def test_greedy_generation_matches_the_dequantised_reference(case):
    name, ref, engine = case
    ids = prompt(7, 9)
    assert engine.generate(ids, max_new_tokens=12)[0] == hf_greedy(ref, ids, 12), name
