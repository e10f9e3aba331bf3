"""What the parity tests of 8-bit heads and attention projections share: transformers on the weights a Colibri
directory dequantises to, and the checks of the cpu backend's prefill logits and greedy tokens against it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import transformers
from safetensors.numpy import save_file

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from tests.helpers import rel_error
from tests.hf_reference import hf_greedy, hf_logits

TOLERANCE = 1e-4
VOCAB = 211


def reference_and_engine(model: ModelDir, tmp: Path, tensors: dict, hf_config: dict):
    """(transformers model on `tensors` under `hf_config`, fp32 eager attention; the cpu engine of `model`)."""
    (tmp / "ref").mkdir()
    save_file(tensors, str(tmp / "ref" / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "ref" / "config.json").write_text(json.dumps(hf_config))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp / "ref", dtype="float32").eval()
    ref.config._attn_implementation = "eager"
    return ref, build_engine(model, EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=1024))


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def check_prefill_logits(case, seed_base: int) -> None:
    """Prompts of 1, 8 and 19 tokens: the engine's logits within TOLERANCE of the reference's."""
    name, ref, engine = case
    for n in (1, 8, 19):
        ids = prompt(seed_base + n, n)
        err = rel_error(engine.prompt_logits(ids), hf_logits(ref, ids))
        assert err <= TOLERANCE, f"{name}: prefill of {n}: relative error {err:.2e}"


def check_greedy_tokens(case, seed: int) -> None:
    """Twelve greedy tokens after a 9-token prompt: the reference's."""
    name, ref, engine = case
    ids = prompt(seed, 9)
    assert engine.generate(ids, max_new_tokens=12)[0] == hf_greedy(ref, ids, 12), name
