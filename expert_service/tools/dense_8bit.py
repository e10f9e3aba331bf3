"""The converter's 8-bit dense matrices: the LM head (`--head-dtype`) and the attention projections
(`--attention-dtype`), each int8 or fp8 with one float32 scale per row, or the dense dtype. Their flags' values are
checked here before anything is read, and a model whose projections cannot take the 8-bit layout is refused."""

from __future__ import annotations

from common import dtypes
from common.attention_format import unsupported_sizes
from common.errors import ModelFormatError
from common.model_config import ModelConfig


def dtype_name(flag: str, name: str | None) -> str | None:
    """`flag`'s canonical dtype name (an 8-bit or a dense dtype), checked before anything is read."""
    canonical = dtypes.EXPERT_ALIASES.get(name.lower()) if isinstance(name, str) else None
    if name is not None and canonical is None:
        raise ModelFormatError(
            f"{flag}: {name!r} is not supported (supported: int8, float8_e4m3fn (fp8), or the dense dtype: "
            f"{', '.join(dtypes.DENSE_DTYPES)} as --dtype)"
        )
    return canonical


def eight_bit(flag: str, canonical: str | None, name: str | None, dense: str) -> str | None:
    """The 8-bit dtype `flag` asks for, or None for the dense dtype; a dense dtype other than --dtype's is refused
    (every tensor but routed experts' and 8-bit head or projections is in the dense dtype)."""
    if canonical is None or canonical in dtypes.QUANTIZED_DTYPES:
        return canonical
    if canonical != dense:
        raise ModelFormatError(
            f"{flag}: {name!r} is not the dense dtype {dense} (supported: int8, float8_e4m3fn (fp8), or {dense})"
        )
    return None


def check_attention_sizes(config: ModelConfig, name: str) -> None:
    """Refuses 8-bit projections for a model whose sizes leave gaps in the stacked q|k|v layout, in one line."""
    if (why := unsupported_sizes(config)) is not None:
        raise ModelFormatError(f"--attention-dtype {name}: {why} (leave the flag out to keep them dense)")
