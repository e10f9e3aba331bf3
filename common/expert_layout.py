"""One routed expert's byte block in an experts file: which tensors, in which order, at which offsets.

    block of expert j of MoE layer L, at byte j * expert_stride[L] of experts-L{L:03d}.bin:
      gate_proj [F, D]  up_proj [F, D]  down_proj [D, F]          in the expert's dtype, row-major [out, in]
      gate scale        up scale        down scale                float32, 8-bit experts only
    each tensor starting at a multiple of TENSOR_ALIGN bytes from the block's start (version 2; version 1
    blocks hold the three matrices back to back with no scales).

The block layout is a pure function of (dtype, scale scheme, F, D): writer and reader both call
``block_layout``, and ``ExpertLayout`` hands consumers (cpu reference, expert caches, kernels) the offsets
so none of them recomputes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from common import dtypes, quant
from common.errors import ModelFormatError


class ManifestView(Protocol):
    """What read_expert_layout reads of a model directory (common.model_format.ModelDir)."""

    @property
    def entries(self) -> Mapping[str, Any]: ...

    @property
    def expert_strides(self) -> Mapping[int, int]: ...

    @property
    def version(self) -> int: ...


EXPERT_ALIGN = 4096  # block start and stride: page-aligned, one copy per expert
TENSOR_ALIGN = 256  # each tensor inside a version-2 block
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
SCALE_SUFFIX = "_scale"


def align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


@dataclass(frozen=True, slots=True)
class ExpertFormat:
    """How one expert is stored: its dtype and, for 8-bit dtypes, its scale scheme."""

    dtype: str  # one of dtypes.STORAGE
    scheme: str | None = None  # quant.CHANNEL or quant.BLOCK128 for 8-bit dtypes, None otherwise

    def __post_init__(self) -> None:
        quantized = self.dtype in dtypes.QUANTIZED_DTYPES
        if self.dtype not in dtypes.STORAGE or quantized != (self.scheme is not None):
            raise ValueError(f"expert format {self.dtype}/{self.scheme}: an 8-bit dtype needs a scale scheme")
        if self.scheme is not None and self.scheme not in quant.SCHEMES:
            raise ValueError(f"scale scheme {self.scheme!r} (supported: {', '.join(quant.SCHEMES)})")
        if self.dtype == "int8" and self.scheme != quant.CHANNEL:
            raise ValueError("int8 experts take per-channel scales only")

    @property
    def is_quantized(self) -> bool:
        return self.scheme is not None

    @property
    def label(self) -> str:
        """ "bfloat16", "int8", "float8_e4m3fn/block128": what summaries and metadata print."""
        return self.dtype if self.scheme is None or self.dtype == "int8" else f"{self.dtype}/{self.scheme}"


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """Where one expert lies: its block in the file and its tensors inside the block (offsets relative to
    `offset`). Scales are float32; `scale_shapes` / `scale_offsets` are empty for 16/32-bit experts."""

    dtype: str
    scheme: str | None
    file: str
    offset: int  # block start in `file`: expert * stride
    nbytes: int  # block bytes up to the end of its last tensor: what one copy moves
    stride: int  # bytes between this layer's experts (>= nbytes, a multiple of EXPERT_ALIGN)
    weight_shapes: tuple[tuple[int, ...], ...]  # gate [F, D], up [F, D], down [D, F]
    weight_offsets: tuple[int, ...]
    scale_shapes: tuple[tuple[int, ...], ...]
    scale_offsets: tuple[int, ...]

    @property
    def format(self) -> ExpertFormat:
        return ExpertFormat(self.dtype, self.scheme)


def expert_shapes(moe_intermediate_size: int, hidden_size: int) -> tuple[tuple[int, int], ...]:
    F, D = moe_intermediate_size, hidden_size
    return ((F, D), (F, D), (D, F))


def block_layout(
    fmt: ExpertFormat, moe_intermediate_size: int, hidden_size: int
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], tuple[int, ...], int]:
    """(weight offsets, scale shapes, scale offsets, block nbytes) of a version-2 block of format `fmt`."""
    shapes = expert_shapes(moe_intermediate_size, hidden_size)
    size = dtypes.itemsize(fmt.dtype)
    weight_offsets, scale_offsets, scale_shapes, end = [], [], [], 0
    for shape in shapes:
        end = align(end, TENSOR_ALIGN)
        weight_offsets.append(end)
        end += shape[0] * shape[1] * size
    if fmt.scheme is not None:
        for shape in shapes:
            end = align(end, TENSOR_ALIGN)
            scale_offsets.append(end)
            scale_shapes.append(quant.scale_shape(fmt.scheme, shape))
            end += 4 * scale_shapes[-1][0] * (scale_shapes[-1][1] if len(scale_shapes[-1]) > 1 else 1)
    return tuple(weight_offsets), tuple(scale_shapes), tuple(scale_offsets), end


def read_expert_layout(model: ManifestView, layer: int, expert: int) -> ExpertLayout:
    """The checked layout of one expert from the manifest's entries: one dtype for its three matrices, a
    float32 scale of a known scheme beside each 8-bit one, and every tensor where its version puts it."""
    prefix = f"layers.{layer}.experts.{expert}."
    weights = [model.entries[prefix + p] for p in PROJECTIONS]
    dtype = weights[0].dtype
    for w in weights[1:]:
        if w.dtype != dtype:
            raise ModelFormatError(f"tensor {w.name}: dtype {w.dtype} differs from {weights[0].name}'s {dtype}")
    schemes = []
    if dtype in dtypes.QUANTIZED_DTYPES:
        for w in weights:
            scale = model.entries.get(scale_name(w.name))
            if scale is None:
                raise ModelFormatError(f"tensor {scale_name(w.name)}: missing (the scale of {dtype} tensor {w.name})")
            scheme = next((s for s in quant.SCHEMES if quant.scale_shape(s, w.shape) == scale.shape), None)
            if scale.dtype != "float32" or scheme is None:
                raise ModelFormatError(
                    f"tensor {scale.name}: {scale.dtype} {list(scale.shape)}, expected float32 "
                    f"{list(quant.scale_shape(quant.CHANNEL, w.shape))} (per channel) or "
                    f"{list(quant.scale_shape(quant.BLOCK128, w.shape))} (128x128 blocks)"
                )
            schemes.append(scheme)
        if len(set(schemes)) != 1 or (dtype == "int8" and schemes[0] != quant.CHANNEL):
            raise ModelFormatError(
                f"tensor {prefix}gate_proj: expert {expert} of layer {layer} mixes scale schemes {schemes} "
                f"(one per expert; int8 takes per-channel scales)"
            )
    fmt = ExpertFormat(dtype, schemes[0] if schemes else None)
    stride, file, base = model.expert_strides[layer], weights[0].file, weights[0].offset
    scales = [model.entries[scale_name(w.name)] for w in weights] if fmt.is_quantized else []
    tensors = weights + scales
    if model.version >= 2:
        weight_offsets, _, scale_offsets, _ = block_layout(fmt, weights[0].shape[0], weights[0].shape[1])
        planned = weight_offsets + scale_offsets
        ok = base == expert * stride and all(t.offset == base + o for t, o in zip(tensors, planned))
    else:  # version 1: the three matrices back to back from expert x stride, where the cuda backend reads them
        planned = (0, weights[0].nbytes, weights[0].nbytes + weights[1].nbytes)
        ok = base == expert * stride and all(t.offset == base + o for t, o in zip(tensors, planned))
    nbytes = tensors[-1].offset + tensors[-1].nbytes - base
    if (
        not ok
        or base % EXPERT_ALIGN
        or stride % EXPERT_ALIGN
        or nbytes > stride
        or any(t.file != file for t in tensors)
    ):
        raise ModelFormatError(
            f"tensor {prefix}gate_proj: expert {expert} of layer {layer} is not one {EXPERT_ALIGN}-byte-aligned "
            f"block at {expert} x stride {stride} holding gate, up, down (then their scales) at their planned offsets"
        )
    return ExpertLayout(
        dtype=dtype,
        scheme=fmt.scheme,
        file=file,
        offset=base,
        nbytes=nbytes,
        stride=stride,
        weight_shapes=tuple(w.shape for w in weights),
        weight_offsets=tuple(w.offset - base for w in weights),
        scale_shapes=tuple(s.shape for s in scales),
        scale_offsets=tuple(s.offset - base for s in scales),
    )
