"""8-bit experts on the cpu backend against transformers running the same dequantised weights in fp32.

Each family converts a tiny fp32 checkpoint with a plan mixing int8, fp8 (128x128 blocks; per channel in the
"/channel" cases) and fp32 experts inside one layer; the reference is the HF model whose expert weights are replaced by what the
Colibri directory dequantises to (q * scale), so any error in layout, scale or dequantisation shows.
The expert cache (fewer slots than experts) must give the same logits as resident experts.
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
from tests.helpers import rel_error
from tests.hf_reference import CASES, hf_greedy, hf_logits, make_hf_model

TOLERANCE = 1e-4
VOCAB = 211
# One case per family, plus dimensions past 128 so 128x128 blocks have full and tail blocks.
FAMILY_CASES = {
    "mixtral-gqa-k2": CASES["mixtral-gqa-k2"],
    "qwen2_moe-shared": CASES["qwen2_moe-shared"],
    "qwen3_moe-k4": CASES["qwen3_moe-k4"],
    "olmoe-clip": CASES["olmoe-clip"],
    "qwen3_moe-wide": (
        "qwen3_moe",
        dict(
            hidden_size=136,
            intermediate_size=48,
            moe_intermediate_size=132,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=34,
            num_experts=5,
            num_experts_per_tok=2,
        ),
    ),
}


def plan_for(num_experts: int, moe_layers: list[int]) -> dict:
    """int8 by default; the last MoE layer fp8 in blocks; in the first, expert 1 fp8 per channel and
    expert 2 kept fp32: one layer mixes three storages."""
    first, last = moe_layers[0], moe_layers[-1]
    plan = {"default": "int8", "layers": {str(last): "fp8"}} if last != first else {"default": "int8"}
    plan["experts"] = {f"{first}.1": "fp8", f"{first}.2": "float32"}
    if num_experts > 3:
        plan["experts"][f"{last}.3"] = "int8" if last != first else "fp8"
    return plan


@pytest.fixture(scope="module", params=sorted(FAMILY_CASES) + ["qwen3_moe-wide/channel", "olmoe-clip/channel"])
def case(request, tmp_path_factory):
    from expert_service.tools.convert import convert

    case_name, _, fp8_scale = request.param.partition("/")
    family, overrides = FAMILY_CASES[case_name]
    tmp = tmp_path_factory.mktemp(case_name)
    hf = make_hf_model(family, overrides, seed=11)
    hf.save_pretrained(tmp / "hf")
    hf_config = json.loads((tmp / "hf" / "config.json").read_text())
    from common.models import config_from_hf

    config = config_from_hf(hf_config)
    plan = {**plan_for(config.num_experts, config.moe_layers), "fp8_scale": fp8_scale or "block128"}
    (tmp / "plan.json").write_text(json.dumps(plan))
    model = ModelDir.open(convert(tmp / "hf", tmp / "model", progress=False, expert_dtype_file=tmp / "plan.json"))
    # The reference: the HF checkpoint with every expert matrix replaced by Colibri's dequantised values.
    tensors = load_file(tmp / "hf" / "model.safetensors")
    for spec in tensor_specs(model.config):
        if spec.expert is not None:
            tensors[spec.hf_name] = model.tensor_f32(spec.name)
    (tmp / "ref").mkdir()
    save_file(tensors, str(tmp / "ref" / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "ref" / "config.json").write_text((tmp / "hf" / "config.json").read_text())
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp / "ref", dtype="float32").eval()
    ref.config._attn_implementation = "eager"
    engine = build_engine(model, EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=1024))
    return request.param, model, ref, engine, tmp


def request_scheme(name: str) -> str:
    return "channel" if name.endswith("/channel") else "block128"


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def test_the_plan_mixes_storages_within_a_layer(case):
    _, model, _, _, _ = case
    first = model.config.moe_layers[0]
    labels = {model.expert_layout(first, e).format.label for e in range(model.config.num_experts)}
    scheme = request_scheme(case[0])
    assert {"int8", "float32", f"float8_e4m3fn/{scheme}"} <= labels
    assert model.expert_strides[first] % 4096 == 0


def test_prefill_logits_match_the_dequantised_reference(case):
    name, _, ref, engine, _ = case
    for n in (1, 9, 21):
        ids = prompt(n, n)
        err = rel_error(engine.prompt_logits(ids), hf_logits(ref, ids))
        assert err <= TOLERANCE, f"{name}: prefill of {n}: relative error {err:.2e}"


def test_greedy_generation_matches_the_dequantised_reference(case):
    name, _, ref, engine, _ = case
    ids = prompt(4, 8)
    assert engine.generate(ids, max_new_tokens=12)[0] == hf_greedy(ref, ids, 12), name


def test_expert_cache_with_quantized_blocks_equals_resident_experts(case):
    name, model, _, engine, _ = case
    cached = build_engine(
        model, EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=1024, expert_cache_slots=2)
    )
    try:
        assert cached.decoder.cache is not None
        for n in (5, 17):
            ids = prompt(30 + n, n)
            assert np.array_equal(cached.prompt_logits(ids), engine.prompt_logits(ids)), name
        ids = prompt(3, 6)
        assert cached.generate(ids, max_new_tokens=8)[0] == engine.generate(ids, max_new_tokens=8)[0]
        assert cached.decoder.cache.total.misses > 0 and cached.decoder.cache.total.bytes_copied > 0
    finally:
        cached.decoder.close()


def test_expert_cache_counts_each_copy_as_its_own_stored_block(case):
    """A layer mixing int8, fp8 and fp32 experts: each copy moves that expert's block (quantized bytes and
    scales), not the largest block of the model, and bytes_copied must say so."""
    name, model, _, _, _ = case
    cached = build_engine(
        model, EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=1024, expert_cache_slots=2)
    )
    copied: list[tuple[int, int]] = []
    engine_copy = cached.decoder.copy_engine.copy

    def recording_copy(layer, expert, slot):
        copied.append((layer, expert))
        return engine_copy(layer, expert, slot)

    cached.decoder.copy_engine.copy = recording_copy
    try:
        for n in (5, 17):
            cached.prompt_logits(prompt(60 + n, n))
        sizes = {model.expert_block(*key)[2] for key in copied}
        assert len(sizes) > 1, f"{name}: the copies should move blocks of several sizes"
        assert cached.decoder.cache.total.bytes_copied == sum(model.expert_block(*key)[2] for key in copied), name
    finally:
        cached.decoder.close()
