"""The cpu backend with 8-bit attention projections: its logits are those of the same model whose projections are
dense float32 matrices holding exactly the dequantised values (q * scale), in every family; the scales are folded in,
not held."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from common.model_format import ModelDir
from expert_service.tools.convert import convert
from tests.expert_service.cpu.test_head_8bit import check_equals_its_dense_twin, engine_of
from tests.expert_service.tools.head_checkpoint import head_config, write_head_checkpoint

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def dense_attention_twin(model: ModelDir, weights: dict[str, np.ndarray], hf_config: dict, out: Path) -> ModelDir:
    """The same checkpoint, its attention projections the 8-bit model's dequantised ones, converted float32."""
    twin = dict(weights)
    for i in range(model.config.num_hidden_layers):
        for p in PROJECTIONS:
            twin[f"model.layers.{i}.self_attn.{p}.weight"] = model.tensor_f32(f"layers.{i}.{p}")
    (out / "hf").mkdir(parents=True)
    (out / "hf" / "config.json").write_text(json.dumps(hf_config))
    save_file(twin, str(out / "hf" / "model.safetensors"))
    return ModelDir.open(convert(out / "hf", out / "m", "float32", False, expert_dtype="int8"))


@pytest.fixture(scope="module", params=[(f, a) for f in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
                for a in ("int8", "fp8")], ids=str)  # fmt: skip
def models(request, tmp_path_factory):
    family, attention_dtype = request.param
    tmp = tmp_path_factory.mktemp(family)
    hf_config = head_config(family, tied=family == "qwen3_moe")
    weights = write_head_checkpoint(tmp / "hf", hf_config, seed=11)
    model = ModelDir.open(
        convert(tmp / "hf", tmp / "m8", "float32", False, expert_dtype="int8", attention_dtype=attention_dtype)
    )
    plain = ModelDir.open(convert(tmp / "hf", tmp / "plain", "float32", False, expert_dtype="int8"))
    return model, dense_attention_twin(model, weights, hf_config, tmp / "twin"), plain


def test_logits_equal_dense_projections_of_the_dequantised_values(models):
    """The 8-bit projections are what ran: the exact ones give other logits."""
    check_equals_its_dense_twin(models, (1, 9, 27))


def test_the_decoder_holds_the_dequantised_projections_and_no_scale(models):
    model, _, _ = models
    decoder = engine_of(model).decoder
    for i in range(model.config.num_hidden_layers):
        for p in PROJECTIONS:
            assert np.array_equal(decoder.w.layer(i, p), model.tensor_f32(f"layers.{i}.{p}"))
            assert f"layers.{i}.{p}_scale" not in decoder.w.dense
    assert dict(decoder.memory_plan())["dense_weights"] == sum(a.nbytes for a in decoder.w.dense.values())
