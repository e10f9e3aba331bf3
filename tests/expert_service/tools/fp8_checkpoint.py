"""Small checkpoints in the fine-grained fp8 layout of Qwen3-*-FP8 / DeepSeek-V3 releases (test helper).

config.json gets `quantization_config` {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128], "modules_to_not_convert": [lm_head, every router]}; every other 2-D
`*.weight` is written as float8_e4m3fn (by torch, as exporters do) with a float32 `*.weight_scale_inv`
[ceil(out/128), ceil(in/128)]; embeddings, norms, biases, routers and lm_head stay bfloat16.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from common import quant
from common.models import config_from_hf, tensor_specs
from expert_service.tools.tiny_model import tiny_weights

QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def unquantized_modules(hf_config: dict) -> list[str]:
    specs = tensor_specs(config_from_hf(hf_config))
    keep = [s.hf_name for s in specs if s.name.endswith(("router", "shared_expert_gate")) or s.name == "lm_head"]
    return [name.removesuffix(".weight") for name in keep]


def write_fp8_checkpoint(
    hf_dir: Path,
    hf_config: dict,
    seed: int = 0,
    scale_suffix: str = "_scale_inv",
    outliers: bool = True,
    scale_dtype: str = "float32",
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Writes the checkpoint, the scales in `scale_dtype` (Qwen3's FP8 releases store bfloat16 or float16 ones);
    returns hf name -> (fp8 bytes as uint8, block scale as stored, widened to float32) of each quantized weight."""
    hf_dir.mkdir(parents=True, exist_ok=True)
    skip = unquantized_modules(hf_config)
    config = {**hf_config, "quantization_config": {**QUANT_CONFIG, "modules_to_not_convert": skip}}
    (hf_dir / "config.json").write_text(json.dumps(config))
    tensors, quantized = {}, {}
    for name, values in tiny_weights(hf_config, seed).items():
        if values.ndim == 2 and "embed_tokens" not in name and name.removesuffix(".weight") not in skip:
            if outliers:  # one large value per matrix: block scales differ from block to block
                values = values.copy()
                values[0, 0] = 8.0
            q, scale = quant.quantize(values, "float8_e4m3fn", quant.BLOCK128, name)
            tensors[name] = torch.from_numpy(q).view(torch.float8_e4m3fn)
            tensors[name + scale_suffix] = torch.from_numpy(scale).to(getattr(torch, scale_dtype))
            quantized[name] = (q, tensors[name + scale_suffix].float().numpy())
        else:
            tensors[name] = torch.from_numpy(values).to(torch.bfloat16)
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return quantized
