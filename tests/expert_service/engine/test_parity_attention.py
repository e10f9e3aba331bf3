"""8-bit attention projections on the cpu backend against transformers running the same dequantised weights in fp32.

Each case converts a tiny fp32 checkpoint with int8 or fp8 projections (and 8-bit experts or head in some); the
reference is the HF model whose projections (and 8-bit experts and head) are what the Colibri directory dequantises
to (q * scale): an error in the stacked layout, a scale or the dequantisation shows, in every family (q/k/v biases,
q/k norms, clipped qkv).
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
    (tmp / "ref").mkdir()
    save_file(tensors, str(tmp / "ref" / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "ref" / "config.json").write_text((tmp / "hf" / "config.json").read_text())
    assert not json.loads((tmp / "ref" / "config.json").read_text()).get("tie_word_embeddings")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp / "ref", dtype="float32").eval()
    ref.config._attn_implementation = "eager"
    engine = build_engine(model, EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=1024))
    return request.param, ref, engine


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def test_prefill_logits_match_the_dequantised_reference(case):
    name, ref, engine = case
    for n in (1, 8, 19):
        ids = prompt(200 + n, n)
        err = rel_error(engine.prompt_logits(ids), hf_logits(ref, ids))
        assert err <= TOLERANCE, f"{name}: prefill of {n}: relative error {err:.2e}"


def test_greedy_generation_matches_the_dequantised_reference(case):
    name, ref, engine = case
    ids = prompt(9, 9)
    assert engine.generate(ids, max_new_tokens=12)[0] == hf_greedy(ref, ids, 12), name
