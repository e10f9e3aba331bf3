"""8-bit attention projections: how a model directory stores them and how the reader checks them.

    dense.bin, each layer i:
      ... q_proj | k_proj | v_proj | q_proj_scale | k_proj_scale | v_proj_scale ... o_proj | o_proj_scale ...
          ^ a multiple of 64, codes back to back ^ next 64-byte boundary, scales back to back
                                                                      ^ 64-aligned    ^ next 64-byte boundary

q_proj [Hq*Hd, D], k_proj and v_proj [Hkv*Hd, D] and o_proj [D, Hq*Hd] are int8 or float8_e4m3fn, every projection
of every layer in one dtype, each with one float32 multiplier per row, "<name>_scale" [out] (the "channel" scheme
of ``common/quant.py``): dequantised = q * scale[:, None]. The codes of q|k|v are then one stacked matrix
[Hq*Hd + 2*Hkv*Hd, D] and their scales one stacked vector right after it: a kernel views the qkv block (codes, then
scales) and the o block (o_proj, then its scale) each as one range. Back to back needs whole 64-byte rows and scale
vectors: hidden_size a multiple of 64, Hq*Hd and Hkv*Hd multiples of 16. Biases and q/k norms stay dense.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from common import dtypes, quant
from common.errors import ModelFormatError
from common.expert_layout import align
from common.head_format import check_placed, row_scale
from common.model_config import ModelConfig
from common.model_manifest import (
    ATTENTION_HIDDEN_MULTIPLE,
    ATTENTION_OUT_MULTIPLE,
    ATTENTION_PROJECTIONS,
    DENSE_ALIGN,
    DENSE_FILE,
    TensorEntry,
    attention_sizes_fit,
)

ATTENTION_SCHEME = quant.CHANNEL  # the only scale scheme of the projections: one scale per row


@dataclass(frozen=True, slots=True)
class AttentionBlocks:
    """One layer's 8-bit projections in dense.bin: the qkv block (q|k|v codes, then their scales) and the o block
    (o_proj, then its scale), each one range [offset, offset + nbytes)."""

    qkv_offset: int  # q_proj's first byte (a multiple of 64)
    qkv_nbytes: int  # to v_proj_scale's last byte
    qkv_scale_offset: int  # q_proj_scale's first byte, from qkv_offset (a multiple of 64)
    o_offset: int  # o_proj's first byte (a multiple of 64)
    o_nbytes: int  # to o_proj_scale's last byte
    o_scale_offset: int  # o_proj_scale's first byte, from o_offset (a multiple of 64)


@dataclass(frozen=True, slots=True)
class AttentionFormat:
    """8-bit attention projections' storage: `ModelDir.attention_format` (None where they are in the dense dtype)."""

    dtype: str  # "int8" or "float8_e4m3fn" (fp8 bytes raw, as uint8), every projection of every layer
    scheme: str  # ATTENTION_SCHEME
    file: str  # DENSE_FILE
    qkv_shape: tuple[int, int]  # the stacked q|k|v codes: [Hq*Hd + 2*Hkv*Hd, hidden_size]
    o_shape: tuple[int, int]  # [hidden_size, Hq*Hd]
    layers: tuple[AttentionBlocks, ...]  # by layer index


def unsupported_sizes(config: ModelConfig) -> str | None:
    """Why this model's projections cannot take the 8-bit layout, in words naming the sizes; None when they can."""
    if attention_sizes_fit(config):
        return None
    return (
        f"8-bit attention projections need hidden_size a multiple of {ATTENTION_HIDDEN_MULTIPLE} and the q and kv "
        f"projection sizes multiples of {ATTENTION_OUT_MULTIPLE}; this model has hidden_size {config.hidden_size}, "
        f"q {config.q_size}, kv {config.kv_size}"
    )


def read_attention_format(entries: Mapping[str, TensorEntry], config: ModelConfig) -> AttentionFormat | None:
    """The checked format of 8-bit attention projections, or None when they are all in the dense dtype (the reader
    has checked every entry's shape against the config, its file and its 64-byte alignment already)."""
    names = [f"layers.{i}.{p}" for i in range(config.num_hidden_layers) for p in ATTENTION_PROJECTIONS]
    eight_bit = [n for n in names if entries[n].dtype in dtypes.QUANTIZED_DTYPES]
    if not eight_bit:
        return None
    first = entries[eight_bit[0]]
    for name in names:
        if entries[name].dtype != first.dtype:
            raise ModelFormatError(
                f"tensor {name}: dtype {entries[name].dtype}, but {first.name} is {first.dtype}: the attention "
                "projections of every layer share one dtype"
            )
    if (why := unsupported_sizes(config)) is not None:
        raise ModelFormatError(f"tensor {first.name}: {why}")
    layers = tuple(_layer_blocks(entries, i, first.dtype) for i in range(config.num_hidden_layers))
    D, q, kv = config.hidden_size, config.q_size, config.kv_size
    return AttentionFormat(first.dtype, ATTENTION_SCHEME, DENSE_FILE, (q + 2 * kv, D), (D, q), layers)


def _layer_blocks(entries: Mapping[str, TensorEntry], layer: int, dtype: str) -> AttentionBlocks:
    q, k, v, o = (entries[f"layers.{layer}.{p}"] for p in ATTENTION_PROJECTIONS)
    check_placed(k, q.offset + q.nbytes, f"right where {q.name} ends")
    check_placed(v, k.offset + k.nbytes, f"right where {k.name} ends")
    q_scale, k_scale, v_scale, o_scale = (row_scale(entries, m) for m in (q, k, v, o))
    check_placed(
        q_scale, align(v.offset + v.nbytes, DENSE_ALIGN), f"at the first {DENSE_ALIGN}-byte boundary after {v.name}"
    )
    check_placed(k_scale, q_scale.offset + q_scale.nbytes, f"right where {q_scale.name} ends")
    check_placed(v_scale, k_scale.offset + k_scale.nbytes, f"right where {k_scale.name} ends")
    check_placed(
        o_scale, align(o.offset + o.nbytes, DENSE_ALIGN), f"at the first {DENSE_ALIGN}-byte boundary after {o.name}"
    )
    return AttentionBlocks(
        qkv_offset=q.offset,
        qkv_nbytes=v_scale.offset + v_scale.nbytes - q.offset,
        qkv_scale_offset=q_scale.offset - q.offset,
        o_offset=o.offset,
        o_nbytes=o_scale.offset + o_scale.nbytes - o.offset,
        o_scale_offset=o_scale.offset - o.offset,
    )
