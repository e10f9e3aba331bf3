"""Random model directories written straight into the model format (no transformers copy), for benches at
real depth: every tensor is a slice of a small pool of random words whose values are finite and small (bf16
around +-0.01, int8 in [-127, 127] with 1e-4 per-channel scales, fp8 e4m3 in +-[1, 1.875] with 1e-2 scales),
so a 31 GB 8-bit Qwen3-30B-A3B-shape model writes at memory speed.

    write_random_model(out_dir, hf_config, expert_dtype="int8")  ->  out_dir
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common import quant
from common.expert_layout import ExpertFormat
from common.model_manifest import ATTENTION_PROJECTIONS
from common.model_writer import ModelWriter

POOL_BYTES = 64 << 20
ATTENTION_SCALES = {f"{p}_scale" for p in ATTENTION_PROJECTIONS}


def _pools(rng) -> dict[str, np.ndarray]:
    """dtype -> a uint8 pool of random bytes of valid, small values of that dtype."""
    raw = rng.integers(0, 256, POOL_BYTES, dtype=np.uint8)
    bf16 = (raw.view(np.uint16) & np.uint16(0x807F)) | np.uint16(0x3C00)  # sign, 7 mantissa bits, 2**-7
    fp8 = (raw & np.uint8(0x87)) | np.uint8(0x38)  # sign, 3 mantissa bits, exponent 2**0 (never the NaN 0x7F)
    int8 = raw.view(np.int8).copy()
    int8[int8 == -128] = -127
    return {
        "bfloat16": bf16.view(np.uint8),
        "float8_e4m3fn": fp8,
        "int8": int8.view(np.uint8),
    }


def _tensor(pools, rng, dtype: str, shape: tuple[int, ...], scale_of: str | None) -> np.ndarray:
    n = int(np.prod(shape))
    if scale_of is not None:  # a float32 scale tensor
        return np.full(shape, 1e-4 if scale_of == "int8" else 1e-2, np.float32)
    pool = pools[dtype]
    item = 2 if dtype == "bfloat16" else 1
    nbytes = n * item
    start = int(rng.integers(0, (pool.size - nbytes) // 16)) * 16 if nbytes < pool.size else 0
    if nbytes <= pool.size:
        raw = pool[start : start + nbytes]
    else:
        raw = np.resize(pool, nbytes)
    if dtype == "bfloat16":
        return raw.view(np.uint16).reshape(shape)
    return raw.view(np.int8 if dtype == "int8" else np.uint8).reshape(shape)


def write_random_model(
    out: Path,
    hf_config: dict,
    expert_dtype: str = "bfloat16",
    seed: int = 0,
    head_dtype: str | None = None,
    attention_dtype: str | None = None,
) -> Path:
    """A bf16 model of `hf_config` whose routed experts are `expert_dtype` (bfloat16, int8, or fp8: e4m3 with
    128x128 block scales), whose LM head is `head_dtype` and attention projections `attention_dtype` (int8 or
    float8_e4m3fn with per-row scales; None: bf16)."""
    rng = np.random.default_rng(seed)
    fmt = {
        "bfloat16": ExpertFormat("bfloat16"),
        "int8": ExpertFormat("int8", quant.CHANNEL),
        "fp8": ExpertFormat("float8_e4m3fn", quant.BLOCK128),
    }[expert_dtype]
    writer = ModelWriter(out, hf_config, "bfloat16", lambda layer, expert: fmt, head_dtype, attention_dtype)
    pools = _pools(rng)
    norms = np.full(hf_config["hidden_size"], 0x3F80, np.uint16)  # 1.0: keep the residual stream's scale
    for name, entry in writer.layout.items():
        if entry.dtype == "bfloat16" and len(entry.shape) == 1 and "norm" in name:
            writer.write(name, np.resize(norms, entry.shape))
            continue
        scale_of = None
        if name.endswith("_scale"):
            scale_of = head_dtype if name == "lm_head_scale" else fmt.dtype
            if name.rsplit(".", 1)[-1] in ATTENTION_SCALES:
                scale_of = attention_dtype
        writer.write(name, _tensor(pools, rng, entry.dtype, tuple(entry.shape), scale_of))
    return writer.finish()
