"""The 8-bit LM head: how a model directory stores it and how the reader checks it.

    dense.bin  ... final_norm | lm_head [V, D] int8 or float8_e4m3fn | lm_head_scale [V] float32
                              ^ offset, a multiple of 64        ^ offset + scale_offset (a multiple of 64)

The scale is one float32 multiplier per row (per output channel, the "channel" scheme of ``common/quant.py``):
dequantised lm_head = q * scale[:, None]. It follows the head at the next 64-byte boundary, so the head and its
scale are one range of dense.bin, [offset, offset + nbytes): a kernel views it as one block. A tied model
(tie_word_embeddings) with an 8-bit head holds the embedding in the dense dtype (the lookup) and this head beside
it (the logits). Without an 8-bit head, lm_head (untied) or embed_tokens (tied) is the head in the dense dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from common import dtypes, quant
from common.errors import ModelFormatError
from common.expert_layout import align, scale_name
from common.model_config import ModelConfig
from common.model_manifest import DENSE_ALIGN, DENSE_FILE, HEAD, MANIFEST, TensorEntry

HEAD_SCHEME = quant.CHANNEL  # the only scale scheme of a head: one scale per row


@dataclass(frozen=True, slots=True)
class HeadFormat:
    """An 8-bit LM head's storage: `ModelDir.head_format` (None where the head is in the dense dtype)."""

    dtype: str  # "int8" or "float8_e4m3fn" (fp8 bytes raw, as uint8)
    scheme: str  # HEAD_SCHEME: a float32 scale per row, shape [vocab_size]
    file: str  # DENSE_FILE
    offset: int  # lm_head's first byte in `file` (a multiple of 64)
    nbytes: int  # from `offset` to the scale's last byte: head and scale as one range
    scale_offset: int  # the scale's first byte, from `offset` (a multiple of 64)
    shape: tuple[int, int]  # lm_head's [vocab_size, hidden_size]


def scale_offset(head: TensorEntry) -> int:
    """Where the head's scale starts in dense.bin: the first 64-byte boundary past the head."""
    return align(head.offset + head.nbytes, DENSE_ALIGN)


def row_scale(entries: Mapping[str, TensorEntry], matrix: TensorEntry) -> TensorEntry:
    """The float32 per-row scale of 8-bit `matrix` (the head, an attention projection), refused in one line when
    missing or of another dtype or shape."""
    name, rows = scale_name(matrix.name), matrix.shape[0]
    scale = entries.get(name)
    if scale is None:
        raise ModelFormatError(f"tensor {name}: missing (the scale of {matrix.dtype} tensor {matrix.name})")
    if scale.dtype != "float32" or scale.shape != (rows,):
        raise ModelFormatError(
            f"tensor {name}: {scale.dtype} {list(scale.shape)}, expected float32 [{rows}] (one per row)"
        )
    return scale


def check_placed(entry: TensorEntry, planned: int, where: str) -> None:
    """`entry` is in dense.bin at byte `planned` (`where` says the place in words), else one line says so."""
    if entry.file != DENSE_FILE or entry.offset != planned:
        raise ModelFormatError(
            f"tensor {entry.name}: stored in {entry.file} at byte {entry.offset}; the format puts it in {DENSE_FILE} "
            f"{where}, at byte {planned}"
        )


def read_head_format(entries: Mapping[str, TensorEntry], config: ModelConfig) -> HeadFormat | None:
    """The checked format of an 8-bit lm_head, or None when the head is in the dense dtype (or tied without one):
    its shape, a float32 [vocab_size] scale beside it and right after it in dense.bin."""
    head = entries.get(HEAD)
    if head is None or head.dtype not in dtypes.QUANTIZED_DTYPES:
        return None
    implied = (config.vocab_size, config.hidden_size)
    if head.shape != implied:  # a tied model's specs have no lm_head to check it against
        raise ModelFormatError(
            f"tensor {HEAD}: shape {list(head.shape)} in {MANIFEST}, config.json implies {list(implied)}"
        )
    scale = row_scale(entries, head)
    check_placed(scale, scale_offset(head), f"right after {HEAD}")  # (the reader has put lm_head in dense.bin)
    return HeadFormat(
        dtype=head.dtype,
        scheme=HEAD_SCHEME,
        file=DENSE_FILE,
        offset=head.offset,
        nbytes=scale.offset + scale.nbytes - head.offset,
        scale_offset=scale.offset - head.offset,
        shape=implied,
    )
