"""Pre-quantized Hugging Face checkpoints: fine-grained fp8 as DeepSeek-V3's and Qwen3's FP8 releases ship it.

    config.json  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                         "activation_scheme": "dynamic", "modules_to_not_convert": [...]}
    tensors      X.weight            F8_E4M3 [out, in]
                 X.weight_scale_inv  F32, BF16 or F16 [ceil(out/128), ceil(in/128)], a multiplier per 128x128
                                     block (widened to float32, exactly)
                                     (some exporters name it X.weight_scale)

Any other `quant_method` (compressed-tensors, gptq, awq, bitsandbytes, ...) is refused in one line, as is any
ambiguity: an fp8 tensor that is not a matrix, two scales for one weight, a scale beside unquantized weights. Only
weights are read: activations run in float32/bf16 here whatever `activation_scheme` says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from common import dtypes, quant
from common.errors import ModelFormatError

SUPPORTED = 'quant_method "fp8" with fmt "e4m3" and weight_block_size [128, 128], or no quantization_config'
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # appended to the weight's name ("...proj.weight_scale_inv")
FP8 = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16")  # Qwen3's FP8 releases store BF16 (some F16) scales, DeepSeek-V3 F32


class Shard(Protocol):
    tensors: dict[str, tuple[str, tuple[int, ...]]]

    def read(self, name: str) -> tuple[np.ndarray, str]: ...


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What config.json says about an fp8 checkpoint: block-scaled weights except the listed modules."""

    not_converted: tuple[tuple[str, str], ...]  # (modules_to_not_convert or ignored_layers, name): unquantized

    def listing(self, hf_name: str) -> str | None:
        """Where config.json lists this tensor's module as unquantized ("ignored_layers entry 'lm_head'"), or None. A
        name lists a module when it is a run of whole components of its dotted path, anywhere in it: "lm_head",
        "mlp.gate", "model.layers.0" and "experts" (every expert) all do."""
        module = "." + hf_name.removesuffix(".weight") + "."
        return next((f"{key} entry {m!r}" for key, m in self.not_converted if m and f".{m}." in module), None)


def read_quantization_config(hf_config: dict, config_path: Path) -> Fp8Checkpoint | None:
    """None for an unquantized checkpoint; refuses every quantization it cannot read exactly."""
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    where = f"{config_path}: quantization_config"
    if not isinstance(q, dict):
        raise ModelFormatError(f"{where} must be an object (supported: {SUPPORTED})")
    method = q.get("quant_method")
    if method != "fp8":
        raise ModelFormatError(f"{where}: quant_method {method!r} is not supported (supported: {SUPPORTED})")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ModelFormatError(f"{where}: fmt {q.get('fmt')!r} is not supported (supported: {SUPPORTED})")
    if q.get("weight_block_size") != [quant.BLOCK, quant.BLOCK]:
        raise ModelFormatError(
            f"{where}: weight_block_size {q.get('weight_block_size')!r} is not supported (supported: {SUPPORTED})"
        )
    skipped: list[tuple[str, str]] = []
    for key in ("modules_to_not_convert", "ignored_layers"):
        value = q.get(key)
        value = [] if value is None else value  # "" or {} is no list either: refused below, not read as none
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ModelFormatError(f"{where}: {key} must be a list of module names, got {value!r}")
        skipped += [(key, name) for name in value]
    return Fp8Checkpoint(tuple(skipped))


def check_fp8_tensor(
    fp8: Fp8Checkpoint | None, where: Mapping[str, Shard], hf_name: str, hf_dir: Path
) -> tuple[str, tuple[int, ...]] | None:
    """Checks one checkpoint tensor against the fp8 rules; returns (scale name, scale shape) when it is
    stored fp8, None when it is not. Run over every tensor before anything is written."""
    dtype, shape = where[hf_name].tensors[hf_name]
    present = [hf_name + suffix for suffix in SCALE_SUFFIXES if hf_name + suffix in where]
    if dtype != FP8:
        if present:  # a scale beside unquantized weights: what it should multiply is anyone's guess
            raise ModelFormatError(f"{hf_dir}: tensor {present[0]}: a scale for {hf_name}, which is {dtype}, not {FP8}")
        return None
    if fp8 is None:
        raise ModelFormatError(
            f"{hf_dir}: tensor {hf_name} is {FP8} but config.json has no quantization_config (supported: {SUPPORTED})"
        )
    if (listing := fp8.listing(hf_name)) is not None:
        raise ModelFormatError(f"{hf_dir}: tensor {hf_name} is {FP8} but config.json's {listing} names its module")
    if len(shape) != 2:
        raise ModelFormatError(
            f"{hf_dir}: tensor {hf_name} is {FP8} {list(shape)}: only matrices are read block-quantized"
        )
    if not present:
        raise ModelFormatError(f"{hf_dir}: tensor {hf_name} is {FP8} but has no {hf_name}_scale_inv (or _scale)")
    if len(present) > 1:  # exporters disagree on whether "_scale" multiplies or divides: never pick one
        raise ModelFormatError(f"{hf_dir}: tensor {hf_name} has both {' and '.join(present)}; expected one scale")
    name, expected = present[0], quant.scale_shape(quant.BLOCK128, shape)
    scale_dtype, scale_shape = where[name].tensors[name]
    if scale_dtype not in SCALE_DTYPES or tuple(scale_shape) != expected:
        raise ModelFormatError(
            f"{hf_dir}: tensor {name} is {scale_dtype} {list(scale_shape)}, expected {' or '.join(SCALE_DTYPES)} "
            f"{list(expected)} (one scale per 128x128 block of {hf_name})"
        )
    return name, expected


def read_scale(where: Mapping[str, Shard], scale_name: str) -> np.ndarray:
    """The block scale as float32 (a bfloat16 or float16 one widened: exact), a copy: it is kept while the other
    tensors are written, and a view would keep the shard's map from closing."""
    stored, dtype = where[scale_name].read(scale_name)
    scale = np.array(dtypes.to_float32(stored, dtype), dtype=np.float32, order="C")
    if not np.isfinite(scale).all():
        raise ModelFormatError(f"tensor {scale_name}: non-finite block scales")
    # zero or negative: refused whether the bytes are kept or dequantised, so no flag turns them into weights
    quant.check_scale_values(scale, "float8_e4m3fn", scale_name)
    return scale
