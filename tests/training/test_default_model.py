"""The shipped default model: checksums, size, parity with transformers, and readable output."""

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from tests.training.conftest import DEFAULT_MODEL_HF

TOLERANCE = 1e-4  # the parity tolerance of every family (tests/expert_service/engine/test_parity_hf.py)
SIZE_LIMIT = 16 * 1024 * 1024  # the converted bfloat16 model must stay small enough to ship


def test_converted_model_verifies_and_stays_small(default_model_bf16):
    model = ModelDir.open(default_model_bf16, verify=False)
    model.verify(progress=False)  # every tensor's crc32, as `colibri verify` does
    size = sum(p.stat().st_size for p in default_model_bf16.iterdir() if p.is_file())
    assert size < SIZE_LIMIT, f"{size:,} bytes"
    config = model.config
    assert (config.num_experts, config.num_experts_per_tok, config.num_hidden_layers) == (8, 2, 6)
    assert (default_model_bf16 / "tokenizer.json").is_file()


@pytest.mark.slow  # about 20 s: both models
def test_logits_and_greedy_tokens_equal_transformers_in_fp32(default_model_fp32, heldout_ids):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.helpers import rel_error
    from tests.hf_reference import hf_greedy, hf_logits

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        DEFAULT_MODEL_HF, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    engine = build_engine(
        ModelDir.open(default_model_fp32), EngineConfig(backend="cpu", kv_block_size=16, kv_cache_tokens=2048)
    )
    for start, length in ((0, 1), (0, 40), (1000, 200)):
        ids = heldout_ids[start : start + length]
        err = rel_error(engine.prompt_logits(ids), hf_logits(hf, ids))
        assert err <= TOLERANCE, f"prefill of {length} tokens: relative error {err:.2e}"
    prompt = heldout_ids[:12]
    ours, _, _ = engine.generate(prompt, max_new_tokens=24)
    assert ours == hf_greedy(hf, prompt, 24)


def test_greedy_continuation_is_english(default_model_bf16):
    """Not byte soup: printable words, most of them alphabetic, many of them the commonest English words."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(default_model_bf16 / "tokenizer.json"))
    engine = build_engine(ModelDir.open(default_model_bf16), EngineConfig(backend="cpu"))
    tokens, _, _ = engine.generate(tokenizer.encode("The king of Babylon").ids, max_new_tokens=24)
    text = tokenizer.decode(tokens)
    words = [w.strip(",.;:!?\"'") for w in text.split()]
    assert text.isprintable() and len(words) >= 10, text
    assert sum(w.isalpha() for w in words) >= 0.8 * len(words), text
    assert np.mean([w.lower() in COMMON_WORDS for w in words]) > 0.3, text


COMMON_WORDS = {
    "the",
    "and",
    "of",
    "to",
    "he",
    "his",
    "him",
    "a",
    "in",
    "will",
    "be",
    "you",
    "i",
    "they",
    "was",
    "is",
    "for",
    "with",
    "them",
    "said",
    "all",
    "who",
    "that",
    "have",
    "not",
    "from",
    "on",
    "their",
    "it",
    "my",
    "your",
    "me",
    "out",
    "into",
    "king",
    "over",
    "came",
    "up",
    "against",
}
