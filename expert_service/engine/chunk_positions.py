"""Where a prompt chunk starts: the router's count of a sequence's tokens (PrefillInput.start_position) against
the engine's. The router sends step t+1 before step t's answer, so when the engine refuses t as a whole, t+1 may
already carry the next chunk of a sequence t was to start or continue; that chunk starts past what the engine
ran. It fails alone (the router fails its request on t's answer) and the rest of t+1 runs; any other mismatch
is a protocol error and refuses the step. A later chunk without a position (0, older routers) is unchecked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from common.errors import InvalidRequestError
from expert_service.engine.step import PrefillInput


class _Sequence(Protocol):
    num_cached: int
    missed_chunk: bool


def check_first_position(chunk: PrefillInput, block_size: int) -> None:
    """A new sequence's first chunk starts after the cached blocks it names."""
    expected = len(chunk.prefix_block_ids) * block_size
    if chunk.start_position and chunk.start_position != expected:
        raise InvalidRequestError(
            "start_position",
            f"sequence {chunk.request_id} is new: its first chunk starts at {expected}, not {chunk.start_position}",
        )


def follows_missed_chunk(seq: _Sequence, chunk: PrefillInput) -> bool:
    """Whether a held sequence's chunk starts past the engine's count because an earlier chunk was refused with
    its step (then it fails alone); refuses any other wrong start."""
    start = chunk.start_position
    if not start or start == seq.num_cached:
        return False
    if start > seq.num_cached and seq.missed_chunk:
        return True
    raise InvalidRequestError(
        "start_position",
        f"sequence {chunk.request_id}: the chunk starts at {start}, the sequence holds {seq.num_cached} tokens",
    )


def mark_missed(sequences: Mapping[int, _Sequence], prefill: Iterable[PrefillInput]) -> None:
    """The step carrying these chunks was refused: the held sequences among them lost a chunk."""
    for chunk in prefill:
        seq = sequences.get(chunk.request_id)
        if seq is not None:
            seq.missed_chunk = True
