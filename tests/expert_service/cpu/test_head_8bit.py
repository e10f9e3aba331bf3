"""The cpu backend with an 8-bit LM head: its logits are those of the same model whose head is a dense float32
matrix holding exactly the dequantised values (q * scale), tied or not; the head's scale is folded in, not held."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.tools.convert import convert
from tests.expert_service.tools.head_checkpoint import head_config, write_head_checkpoint
from tests.helpers import rel_error

TOLERANCE = 1e-5


def engine_of(model: ModelDir):
    return build_engine(model, EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=512))


def dense_head_twin(model: ModelDir, weights: dict[str, np.ndarray], hf_config: dict, out: Path) -> ModelDir:
    """The same checkpoint, untied, its lm_head.weight the 8-bit model's dequantised head, converted float32."""
    (out / "hf").mkdir(parents=True)
    (out / "hf" / "config.json").write_text(json.dumps({**hf_config, "tie_word_embeddings": False}))
    save_file({**weights, "lm_head.weight": model.tensor_f32("lm_head")}, str(out / "hf" / "model.safetensors"))
    return ModelDir.open(convert(out / "hf", out / "m", "float32", False, expert_dtype="int8"))


@pytest.fixture(scope="module", params=[(f, t, h) for f, t in (("mixtral", True), ("qwen2_moe", False),
                ("qwen3_moe", True), ("olmoe", False)) for h in ("int8", "fp8")], ids=str)  # fmt: skip
def models(request, tmp_path_factory):
    family, tied, head_dtype = request.param
    tmp = tmp_path_factory.mktemp(family)
    hf_config = head_config(family, tied)
    weights = write_head_checkpoint(tmp / "hf", hf_config, seed=9)
    convert_8bit = convert(tmp / "hf", tmp / "m8", "float32", False, expert_dtype="int8", head_dtype=head_dtype)
    model = ModelDir.open(convert_8bit)
    plain = ModelDir.open(convert(tmp / "hf", tmp / "plain", "float32", False, expert_dtype="int8"))
    return model, dense_head_twin(model, weights, hf_config, tmp / "twin"), plain


def random_prompt(seed: int, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def check_equals_its_dense_twin(models, lengths: tuple[int, ...]) -> None:
    """models = (8-bit model, its twin holding the dequantised values in float32, the model converted without the 8-bit
    part): prompt logits equal the twin's within TOLERANCE and differ from the exact model's (the 8-bit values are
    what ran), greedy tokens equal the twin's."""
    model, twin, plain = models
    ours, dense, exact = engine_of(model), engine_of(twin), engine_of(plain)
    vocab = model.config.vocab_size
    for seed, n in enumerate(lengths, start=1):
        ids = random_prompt(seed, n, vocab)
        logits = ours.prompt_logits(ids)
        assert rel_error(logits, dense.prompt_logits(ids)) <= TOLERANCE
        assert rel_error(logits, exact.prompt_logits(ids)) > 10 * TOLERANCE
    ids = random_prompt(len(lengths) + 1, 6, vocab)
    assert ours.generate(ids, max_new_tokens=10)[0] == dense.generate(ids, max_new_tokens=10)[0]


def test_logits_equal_a_dense_head_of_the_dequantised_values(models):
    """The 8-bit head is what ran: the exact head (or a tied embedding) gives other logits."""
    check_equals_its_dense_twin(models, (1, 7, 23))


def test_the_decoder_holds_the_dequantised_head_and_no_scale(models):
    model, _, _ = models
    decoder = engine_of(model).decoder
    assert np.array_equal(decoder.w.lm_head, model.tensor_f32("lm_head"))
    assert "lm_head_scale" not in decoder.w.dense
    assert dict(decoder.memory_plan())["dense_weights"] == sum(a.nbytes for a in decoder.w.dense.values())
    if model.config.tie_word_embeddings:  # the lookup keeps the dense embedding
        assert np.array_equal(decoder.w.get("embed_tokens"), model.tensor_f32("embed_tokens"))
        assert not np.array_equal(decoder.w.lm_head, decoder.w.get("embed_tokens"))
