"""Hand-built tiny models with known routing properties, shared by the routing-table and LUT worker tests."""
from __future__ import annotations

import json
from pathlib import Path

from common.models import config_from_hf, tensor_specs
from expert_service.tiny_model import write_tiny_checkpoint

TOKEN_DIMS = 16     # residual dims that keep the embedding untouched through every layer


def make_token_routed_model(tmp_path: Path, seed: int = 0, token_dims: int = TOKEN_DIMS) -> Path:
    """A tiny mixtral whose exact routing depends only on the token id, at every MoE layer.

    The first `token_dims` rows of every o_proj and expert down_proj are zero, so those residual dims carry
    the embedding unchanged into every layer; the router columns outside them are zero, so the gate sees
    only those dims. The post-attention RMSNorm multiplies them by a positive per-token scale (it depends
    on the context) times a fixed weight, and a positive scale never changes a top-k ranking.
    Mixtral has no shared expert or dense layer that could write into those dims. Returns the model dir.
    """
    from safetensors.numpy import load_file, save_file

    from expert_service.convert import convert

    hf_dir = write_tiny_checkpoint(Path(tmp_path) / "token_routed_hf", "mixtral", seed)
    config = config_from_hf(json.loads((hf_dir / "config.json").read_text()))
    weights = load_file(str(hf_dir / "model.safetensors"))
    for spec in tensor_specs(config):
        leaf = spec.name.rsplit(".", 1)[-1]
        if leaf in ("o_proj", "down_proj"):            # [D, in]: rows are residual dims
            weights[spec.hf_name][:token_dims] = 0.0
        elif leaf == "router":                          # [E, D]: columns are residual dims
            weights[spec.hf_name][:, token_dims:] = 0.0
    save_file(weights, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return convert(hf_dir, Path(tmp_path) / "token_routed", progress=False)
