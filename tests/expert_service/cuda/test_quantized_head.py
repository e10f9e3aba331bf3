"""The cuda backend with an 8-bit LM head (linear_q8) against the cpu backend on the same converted model (GPU
only): int8 and fp8 heads, untied and tied (the 8-bit head beside the embedding the lookup reads), with bf16
experts and with int8 ones; greedy tokens equal, logits of batched decode and of prompts within the bf16
tolerance, graphs and eager."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.tools.convert import convert
from expert_service.tools.tiny_model import write_tiny_checkpoint
from tests.expert_service.cuda.test_quantized import (
    CFG,
    EXACT_ACTIVATIONS,
    check_batched_decode,
    check_greedy_tokens,
    check_prompt_logits,
)
from tests.helpers import random_prompt

pytestmark = pytest.mark.gpu

# (family, head dtype, expert dtype, tied, vocabulary): 259 (the tokenizer's) runs the weight stream at every row
# count; 272, a multiple of 16, takes the tensor-core GEMM past TOK_TILE rows
VARIANTS = [
    ("qwen3_moe", "int8", None, False, 259),
    ("mixtral", "float8_e4m3fn", None, False, 272),
    ("qwen3_moe", "int8", "int8", True, 272),
    ("mixtral", "int8", "fp8", False, 259),
    ("qwen3_moe", "float8_e4m3fn", "int8", True, 259),
]


def tiny_checkpoint(hf_dir, family: str, tied: bool, vocab: int = 259):
    """The tiny checkpoint; tied: its config ties the head to the embedding and it holds no lm_head; vocab: rows
    of the embedding and head (past the tokenizer's 259: random rows as the others)."""
    write_tiny_checkpoint(hf_dir, family, seed=13)
    config = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(hf_dir / "model.safetensors")
    rng = np.random.default_rng(vocab)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name]
        extra = rng.standard_normal((vocab - w.shape[0], w.shape[1])).astype(w.dtype) * w.std()
        weights[name] = np.concatenate([w, extra])
    if tied:
        del weights["lm_head.weight"]
    (hf_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": tied, "vocab_size": vocab}))
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    return hf_dir


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda p: "-".join(str(v) for v in p))
def engines(request, tmp_path_factory):
    family, head, experts, tied, vocab = request.param
    root = tmp_path_factory.mktemp(f"{family}-{head}")
    hf = tiny_checkpoint(root / "hf", family, tied, vocab)
    model = convert(hf, root / "converted", "bfloat16", progress=False, expert_dtype=experts, head_dtype=head)
    opened = ModelDir.open(model)
    assert opened.entries["lm_head"].dtype == head and opened.config.tie_word_embeddings == tied
    open_ = lambda **kw: build_engine(ModelDir.open(model), EngineConfig(**{**CFG, **kw}))  # noqa: E731
    gpus = {
        "graphs": open_(backend="cuda", cuda_options=EXACT_ACTIVATIONS),
        "eager": open_(backend="cuda", cuda_options=EXACT_ACTIVATIONS, cuda_graphs=False),
    }
    assert gpus["graphs"].decoder.model.head_8bit[1].mma == (vocab % 16 == 0)
    return "-".join(str(v) for v in request.param), open_(backend="cpu"), gpus


def test_greedy_tokens_match_cpu(engines):
    check_greedy_tokens(engines, (1, 6, 70), seed=90)


def test_batched_decode_logits_close_to_cpu(engines):
    prompts = [random_prompt(60 + i, n) for i, n in enumerate((3, 9, 40, 80, 5, 17))]  # 6 rows: past one token tile
    check_batched_decode(engines, prompts, first_id=300, steps=4)


def test_prompt_logits_close_to_cpu(engines):
    check_prompt_logits(engines, (1, 40), seed=80)
