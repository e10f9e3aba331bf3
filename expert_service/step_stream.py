"""The worker's side of the step stream: the router's steps, run back to back.

Each request that arrives is converted on the event loop and queued at once on the model thread (one
worker thread, so steps run in arrival order); the model thread never waits for the router or for the
event loop between steps. A decode is fed the token its sequence sampled in the step before, which the
engine keeps, so the router can send step t+1 before it has seen step t's tokens. Frees travel inside the
step and run before it. A session owns the sequences its stream started: it may step or free only those,
and when the stream ends (the router went away) they are freed. The unary Prefill/Decode calls run through
one more session of their own (UNARY), so neither path can touch the other's sequences.

Every step is checked against the worker's limits before anything is converted (token and sequence counts,
free ids), and while the worker drains, a chunk that would start a new sequence is refused for that sequence
alone (DRAINING); the sequences already held keep stepping.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from common.errors import CapacityError, InvalidRequestError
from common.pb import worker_pb2
from common.routing_plan import RoutingPlan
from expert_service.engine import Engine, PrefillInput, SeqOutput, StepResult

FOREIGN_SEQUENCE = "FOREIGN_SEQUENCE"
DRAINING = "DRAINING"
UNARY = 0                       # the owner of sequences started by the unary Prefill call
MAX_FREE_IDS = 1 << 16
_session_ids = itertools.count(UNARY + 1)


@dataclass(frozen=True, slots=True)
class StepLimits:
    """What one step may carry (the engine's limits), checked before the step's arrays are built."""
    moe_layers: tuple[int, ...]
    max_batch_tokens: int
    max_batch_size: int

    @classmethod
    def of(cls, engine: Engine) -> StepLimits:
        return cls(tuple(engine.model_config.moe_layers), engine.config.max_batch_tokens,
                   engine.config.max_batch_size)

    def check(self, chunks, num_decodes: int, num_frees: int) -> None:
        tokens = sum(len(c.token_ids) for c in chunks) + num_decodes
        if tokens > self.max_batch_tokens:
            raise InvalidRequestError("step", f"{tokens} tokens exceed max_batch_tokens {self.max_batch_tokens}")
        if len(chunks) + num_decodes > self.max_batch_size:
            raise InvalidRequestError("step", f"{len(chunks) + num_decodes} sequences exceed max_batch_size "
                                              f"{self.max_batch_size}")
        if num_frees > MAX_FREE_IDS:
            raise InvalidRequestError("free_request_ids", f"{num_frees} ids, at most {MAX_FREE_IDS} per step")


def _ids(data: bytes, field: str) -> np.ndarray:
    if len(data) % 8:
        raise InvalidRequestError(field, f"{len(data)} bytes is not a whole number of uint64 ids")
    return np.frombuffer(data, dtype="<u8")


@dataclass(frozen=True, slots=True)
class StreamStep:
    step_id: int
    free_ids: np.ndarray             # [n] uint64: sequences to free before the step
    chunks: list[PrefillInput]
    decode_ids: np.ndarray           # [m] uint64
    routing_plan: RoutingPlan | None

    @classmethod
    def from_pb(cls, request: worker_pb2.StepStreamRequest, limits: StepLimits) -> StreamStep:
        frees, decodes = (_ids(request.free_request_ids, "free_request_ids"),
                          _ids(request.decode_request_ids, "decode_request_ids"))
        limits.check(request.chunks, len(decodes), len(frees))
        plan = RoutingPlan.from_pb(request.routing_plan, limits.moe_layers) \
            if request.HasField("routing_plan") else None
        return cls(request.step_id, frees, [PrefillInput.from_pb(c) for c in request.chunks], decodes, plan)

    @classmethod
    def from_unary(cls, request: worker_pb2.PrefillRequest | worker_pb2.DecodeRequest,
                   limits: StepLimits) -> StreamStep:
        """A unary Prefill (chunks, decodes riding along) or Decode call as a step."""
        if isinstance(request, worker_pb2.PrefillRequest):
            chunks, decodes = request.chunks, request.decode_request_ids
        else:
            chunks, decodes = (), request.request_ids
        limits.check(chunks, len(decodes), 0)
        plan = RoutingPlan.from_pb(request.routing_plan, limits.moe_layers) \
            if request.HasField("routing_plan") else None
        return cls(0, np.zeros(0, "<u8"), [PrefillInput.from_pb(c) for c in chunks],
                   np.fromiter(decodes, "<u8", len(decodes)), plan)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not len(self.decode_ids)


@dataclass
class StepOutcome:
    """What the model thread hands back for one step: a result, or why the whole step was refused."""
    step_id: int
    result: StepResult | None
    refused: str
    seconds: float
    kind: str = "decode"      # "prefill" when the step carried prompt chunks (the step-duration metric's label)
    capacity: bool = False    # refused for want of KV blocks (RESOURCE_EXHAUSTED), not as malformed


class StreamSession:
    """One router stream's sequences and its steps on the model thread (every method below runs there)."""

    def __init__(self, engine: Engine, owners: dict[int, int], draining=lambda: False,
                 session_id: int | None = None):
        self.engine = engine
        self.id = next(_session_ids) if session_id is None else session_id
        self.owners = owners          # sequence id -> session id, shared by every session of the worker
        self.draining = draining      # () -> bool: new sequences are refused while it is true

    def run(self, step: StreamStep) -> StepOutcome:
        started = time.perf_counter()
        self._free(int(r) for r in step.free_ids)
        if step.is_empty:
            return StepOutcome(step.step_id, None, "", time.perf_counter() - started, "free")
        refused = [SeqOutput(r, error=FOREIGN_SEQUENCE) for r in self._foreign(step)]
        chunks = [c for c in step.chunks if self.owners.get(c.request_id, self.id) == self.id]
        if self.draining():
            held = self.engine.sequences
            refused += [SeqOutput(c.request_id, error=DRAINING) for c in chunks if c.request_id not in held]
            chunks = [c for c in chunks if c.request_id in held]
        decodes = [int(r) for r in step.decode_ids if self.owners.get(int(r), self.id) == self.id]
        for chunk in chunks:
            self.owners.setdefault(chunk.request_id, self.id)
        kind = "prefill" if step.chunks else "decode"
        try:
            result = self.engine.step(chunks, decodes, step.routing_plan)
        except (InvalidRequestError, CapacityError) as e:
            self._forget_unknown(chunks)
            return StepOutcome(step.step_id, None, str(e), time.perf_counter() - started, kind,
                               isinstance(e, CapacityError))
        for out in result.outputs:     # a failed sequence the engine still holds (a decode sent mid-prefill)
            if out.error and out.request_id not in self.engine.sequences:   # stays ours to free
                self.owners.pop(out.request_id, None)
        result.outputs += refused
        return StepOutcome(step.step_id, result, "", time.perf_counter() - started, kind)

    def close(self) -> None:
        """The stream ended: free every sequence it started."""
        self._free([r for r, owner in self.owners.items() if owner == self.id])

    def _foreign(self, step: StreamStep) -> list[int]:
        ids = [c.request_id for c in step.chunks] + [int(r) for r in step.decode_ids]
        return [r for r in ids if self.owners.get(r, self.id) != self.id]

    def _free(self, request_ids) -> None:
        mine = [r for r in request_ids if self.owners.get(r) == self.id]
        for r in mine:
            del self.owners[r]
        self.engine.release(mine)

    def _forget_unknown(self, chunks: list[PrefillInput]) -> None:
        """A refused step started nothing: drop ownership the engine never took up."""
        for chunk in chunks:
            if chunk.request_id not in self.engine.sequences:
                self.owners.pop(chunk.request_id, None)
