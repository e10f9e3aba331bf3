"""Small checkpoints for the 8-bit LM head's tests (test helper): the tiny model of a family, tied or not, with
odd sizes so neither the head (vocab 259 rows) nor its scale is a multiple of 64 bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from expert_service.tools.tiny_model import tiny_hf_config, tiny_weights


def head_config(family: str = "mixtral", tied: bool = False, **overrides) -> dict:
    return {**tiny_hf_config(family), "tie_word_embeddings": tied, **overrides}


def write_head_checkpoint(hf_dir: Path, hf_config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """config.json and model.safetensors (float32) of `hf_config`: a tied one has no lm_head.weight. Returns the
    weights by HF name."""
    hf_dir.mkdir(parents=True, exist_ok=True)
    (hf_dir / "config.json").write_text(json.dumps(hf_config))
    weights = tiny_weights(hf_config, seed)
    save_file(weights, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return weights
