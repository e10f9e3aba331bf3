"""The Colibri model directory, version 2, and its manifest: this docstring is the specification; the writer
(``common/model_writer.py``) and the reader (``common/model_format.py``) follow it. This module holds what both
share: the file names, the manifest's tensor entries with their type and range checks, and the layout plan.

    MODEL_DIR/
      colibri.json          manifest (UTF-8 JSON, below)
      dense.bin             every non-expert tensor, each starting at a multiple of 64 bytes
      experts-L{i:03d}.bin  routed experts of MoE layer i: expert j occupies the block starting at byte
                            j * expert_strides[i] (a multiple of 4096, the largest block of the layer); the
                            block's layout is in ``common/expert_layout.py``: gate_proj [F, D], up_proj [F, D],
                            down_proj [D, F] in the expert's dtype, then (8-bit experts) their float32 scales,
                            each tensor 256-byte aligned, so one expert is one contiguous range = one copy
      tokenizer.json, ...   tokenizer files copied from the checkpoint (optional)

    colibri.json = {
      "format": "colibri", "format_version": 2,
      "family": "<HF model_type>",
      "dtype": "float32" | "float16" | "bfloat16",     # the dense dtype: every tensor but routed experts'
      "config": {...},                                  # the HF config.json, keys unchanged
      "expert_stride": <the largest of expert_strides>, # what an expert cache sizes a slot by
      "expert_strides": {"<MoE layer>": <bytes between experts of that layer>, ...},
      "tensors": {"<canonical name>": {"file": "<relative path>", "offset": <bytes>, "nbytes": <bytes>,
                                       "dtype": "<dtype>", "shape": [..], "crc32": <uint32 of the bytes>}},
      "tokenizer_files": ["tokenizer.json", ...]
    }

Every tensor records its own dtype. Routed experts' matrices may be "int8" (per-output-channel scale) or
"float8_e4m3fn" (per-channel or 128x128-block scale); their scale is the float32 tensor "<name>_scale"
([out] or [ceil(out/128), ceil(in/128)], dequantised = q * scale, ``common/quant.py``). One expert has one
dtype; experts of a layer may differ. The LM head may be 8-bit too (``common/head_format.py``): "lm_head" int8 or
"float8_e4m3fn" with a float32 per-row scale "lm_head_scale" [vocab_size] right after it in dense.bin; a tied model
(tie_word_embeddings) then holds both "embed_tokens" in the dense dtype and the 8-bit "lm_head". The attention
projections q_proj, k_proj, v_proj and o_proj may be 8-bit too (``common/attention_format.py``): all of them in one
of those dtypes, each with a float32 per-row "<name>_scale" [out], q|k|v and their scales laid out as one block.
Everything else stays in the dense dtype.

Version 1 (still read): one "dtype" for every tensor, one "expert_stride", no scales, the three matrices of
an expert back to back with no gaps.

Canonical tensor names and shapes are listed in ``common.models``. Matrices are row-major [out, in].
bfloat16 is stored as raw 16-bit words, float8_e4m3fn as raw bytes. All integers little-endian.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from common import dtypes
from common.errors import ModelFormatError
from common.expert_layout import EXPERT_ALIGN, PROJECTIONS, SCALE_SUFFIX, ExpertFormat, align, block_layout, scale_name
from common.model_config import ModelConfig
from common.models import tensor_specs

FORMAT_NAME = "colibri"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "colibri.json"
DENSE_FILE = "dense.bin"
DENSE_ALIGN = 64
MAX_DIM = 1 << 31  # one tensor dimension
MAX_FILE_BYTES = 1 << 48  # offsets and sizes: far past any disk, far below int64 overflow
HEAD = "lm_head"
HEAD_SCALE = scale_name(HEAD)  # an 8-bit head's per-row float32 scale, right after it in dense.bin
EXPERT_MATRIX = re.compile(r"layers\.(\d+)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)")
QKV = ("q_proj", "k_proj", "v_proj")
ATTENTION_PROJECTIONS = (*QKV, "o_proj")  # may be 8-bit, all in one dtype (``common/attention_format.py``)
ATTENTION_MATRIX = re.compile(r"layers\.(\d+)\.(q_proj|k_proj|v_proj|o_proj)")
# 8-bit projections back to back need whole 64-byte rows of codes and whole 64-byte float32 scale vectors
ATTENTION_HIDDEN_MULTIPLE, ATTENTION_OUT_MULTIPLE = 64, 16

ExpertFormats = Callable[[int, int], ExpertFormat]  # (layer, expert) -> how that expert is stored


def expert_file(layer: int) -> str:
    return f"experts-L{layer:03d}.bin"


def planned_file(name: str) -> str:
    """The file a tensor of this name lives in: its layer's experts file for a routed expert's matrix or
    scale, dense.bin for every other tensor."""
    match = EXPERT_MATRIX.fullmatch(name.removesuffix(SCALE_SUFFIX))
    return expert_file(int(match[1])) if match else DENSE_FILE


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor's record in the manifest's "tensors": where its bytes are, what they hold, their crc32."""

    name: str
    file: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    crc32: int

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "crc32": self.crc32,
        }


def tensor_entry(name: str, raw: object) -> TensorEntry:
    """One manifest tensor entry, every field of the type and range the loader relies on."""

    if not isinstance(raw, dict):
        raise ModelFormatError(f"tensor {name}: manifest entry must be an object")

    def integer(key: str, hi: int) -> int:
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
            raise ModelFormatError(f"tensor {name}: {key} must be an integer in [0, {hi}], got {value!r}")
        return value

    try:
        shape = raw["shape"]
        if (
            not isinstance(shape, list)
            or len(shape) > 8
            or any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < MAX_DIM for d in shape)
        ):
            raise ModelFormatError(
                f"tensor {name}: shape must be a list of at most 8 sizes in [0, {MAX_DIM}), got {shape!r}"
            )
        if not isinstance(raw["file"], str) or not isinstance(raw["dtype"], str):
            raise ModelFormatError(f"tensor {name}: file and dtype must be strings")
        return TensorEntry(
            name,
            raw["file"],
            integer("offset", MAX_FILE_BYTES),
            integer("nbytes", MAX_FILE_BYTES),
            raw["dtype"],
            tuple(shape),
            integer("crc32", 0xFFFFFFFF),
        )
    except KeyError as e:
        raise ModelFormatError(f"tensor {name}: manifest entry lacks {e}") from None


def check_disjoint(entries: Iterable[TensorEntry]) -> None:
    """No byte belongs to two tensors. Experts sit in planned blocks, but dense tensors only on 64-byte
    boundaries: one pointed into another's bytes (its crc32 taken there) would pass every other check."""
    by_file: dict[str, list[TensorEntry]] = {}
    for entry in entries:
        by_file.setdefault(entry.file, []).append(entry)
    for file, in_file in by_file.items():
        in_file.sort(key=lambda e: (e.offset, e.nbytes))
        reach = in_file[0]  # of the entries so far, the one ending last
        for entry in in_file[1:]:
            if entry.offset < reach.offset + reach.nbytes:
                raise ModelFormatError(
                    f"tensor {entry.name}: bytes {entry.offset}...{entry.offset + entry.nbytes} of {file} overlap "
                    f"tensor {reach.name} (bytes {reach.offset}...{reach.offset + reach.nbytes}); each tensor has "
                    "bytes of its own"
                )
            if entry.offset + entry.nbytes > reach.offset + reach.nbytes:
                reach = entry


def byte_count(value: object, key: str) -> int:
    """A manifest byte count (an offset, a stride), refused unless an integer in range."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_FILE_BYTES:
        raise ModelFormatError(f"{MANIFEST}: {key} must be an integer in [0, {MAX_FILE_BYTES}], got {value!r}")
    return value


def attention_sizes_fit(config: ModelConfig) -> bool:
    """Whether 8-bit attention projections of this model lie back to back with no gap (``common/attention_format.py``)."""
    return not (
        config.hidden_size % ATTENTION_HIDDEN_MULTIPLE
        or config.q_size % ATTENTION_OUT_MULTIPLE
        or config.kv_size % ATTENTION_OUT_MULTIPLE
    )


def _scales_after(config: ModelConfig, name: str) -> tuple[tuple[str, int], ...]:
    """(scale, rows) that 8-bit attention projections place right after projection `name`: q|k|v's after v_proj
    (from the next 64-byte boundary, back to back), o_proj's after o_proj."""
    layer, projection = name.split(".")[1:]
    rows = {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size, "o_proj": config.hidden_size}
    after = {"v_proj": QKV, "o_proj": ("o_proj",)}.get(projection, ())
    return tuple((scale_name(f"layers.{layer}.{p}"), rows[p]) for p in after)


def plan_layout(
    config: ModelConfig,
    dtype: str,
    expert_formats: ExpertFormats | None = None,
    head_dtype: str | None = None,
    attention_dtype: str | None = None,
) -> tuple[dict[str, TensorEntry], dict[int, int]]:
    """Where every tensor goes (crc32 left 0) and each MoE layer's expert stride: a pure function of the
    config, the dense dtype, each expert's format (default: the dense dtype), the LM head's 8-bit dtype
    (None: the dense dtype) and the attention projections' (None: the dense dtype). An 8-bit head ends dense.bin,
    tied or not, its per-row scale right after it; 8-bit projections sit as ``common/attention_format.py`` says,
    which takes hidden_size a multiple of 64 and q/kv sizes multiples of 16 (those make every gap zero)."""
    if attention_dtype is not None:
        if attention_dtype not in dtypes.QUANTIZED_DTYPES:
            raise ValueError(f"attention dtype {attention_dtype!r}: an 8-bit dtype, or None for the dense dtype")
        if not attention_sizes_fit(config):
            raise ValueError(
                f"8-bit attention projections: hidden_size {config.hidden_size}, q {config.q_size}, "
                f"kv {config.kv_size} leave gaps between q|k|v"
            )
    formats = expert_formats or (lambda layer, expert: ExpertFormat(dtype))
    F, D = config.moe_intermediate_size, config.hidden_size
    blocks = {
        (layer, j): (formats(layer, j), *block_layout(formats(layer, j), F, D))
        for layer in config.moe_layers
        for j in range(config.num_experts)
    }
    strides = {
        layer: align(max(blocks[layer, j][4] for j in range(config.num_experts)), EXPERT_ALIGN)
        for layer in config.moe_layers
    }
    entries, dense_offset = {}, 0

    def dense(name: str, shape: tuple[int, ...], stored: str) -> None:
        nonlocal dense_offset
        nbytes = math.prod(shape) * dtypes.itemsize(stored)
        dense_offset = align(dense_offset, DENSE_ALIGN)
        entries[name] = TensorEntry(name, DENSE_FILE, dense_offset, nbytes, stored, shape, 0)
        dense_offset += nbytes

    for spec in tensor_specs(config):
        if spec.expert is None:
            if attention_dtype is not None and ATTENTION_MATRIX.fullmatch(spec.name):
                dense(spec.name, spec.shape, attention_dtype)
                for name, rows in _scales_after(config, spec.name):
                    dense(name, (rows,), "float32")
                continue
            dense(spec.name, spec.shape, dtype if spec.name != HEAD or head_dtype is None else head_dtype)
            continue
        assert spec.layer is not None  # tensor_specs gives every expert matrix its layer
        fmt, weight_offsets, scale_shapes, scale_offsets, _ = blocks[spec.layer, spec.expert]
        index = PROJECTIONS.index(spec.name.rsplit(".", 1)[1])
        base, file = spec.expert * strides[spec.layer], expert_file(spec.layer)
        nbytes = math.prod(spec.shape) * dtypes.itemsize(fmt.dtype)
        entries[spec.name] = TensorEntry(
            spec.name, file, base + weight_offsets[index], nbytes, fmt.dtype, spec.shape, 0
        )
        if fmt.is_quantized:
            name, shape = scale_name(spec.name), scale_shapes[index]
            entries[name] = TensorEntry(
                name, file, base + scale_offsets[index], 4 * math.prod(shape), "float32", shape, 0
            )
    if head_dtype is not None:  # tensor_specs ends with lm_head, or (tied) with final_norm: the head comes last
        if head_dtype not in dtypes.QUANTIZED_DTYPES:
            raise ValueError(f"head dtype {head_dtype!r}: an 8-bit dtype, or None for the dense dtype")
        if config.tie_word_embeddings:
            dense(HEAD, (config.vocab_size, config.hidden_size), head_dtype)
        dense(HEAD_SCALE, (config.vocab_size,), "float32")
    return entries, strides
