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

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import Set
from dataclasses import dataclass, field

import numpy as np

from common.errors import CapacityError, InvalidRequestError
from common.routing_plan import RoutingPlan
from expert_service.engine.engine import Engine, InFlightStep, PrefillInput, SequenceOutput, StepResult
from expert_service.engine.prefix_blocks import sequence_block_registrations

log = logging.getLogger("colibri.worker")
FOREIGN_SEQUENCE = "FOREIGN_SEQUENCE"
DRAINING = "DRAINING"
UNARY = 0  # the owner of sequences started by the unary Prefill call
MAX_FREE_IDS = 1 << 16
MAX_STEPS_AHEAD = 8  # a stream's steps received and not yet answered (the router keeps at most 4 in flight)
POLL_S = 5e-5  # a pump waiting on the device looks this often for the router's next step
# A step waiting for late masks holds the model thread until the router's next message brings them (one round
# trip); past this the router is taken to have lost them and the step's late rows fail (MISSING_TOKEN_MASK).
LATE_MASKS_TIMEOUT_S = 5.0
_session_ids = itertools.count(UNARY + 1)


@dataclass(frozen=True, slots=True)
class StepLimits:
    """What one step may carry (the engine's limits), checked before the step's arrays are built."""

    moe_layers: tuple[int, ...]
    max_batch_tokens: int
    max_batch_size: int
    vocab_size: int = 0  # the logits width: a token mask's bits
    num_kv_blocks: int = 0  # the pool: a router may evict, register or start a sequence on each of its blocks

    @property
    def max_block_ids(self) -> int:
        """Block ids one step may name (evicted and registered together), and cached blocks a chunk may start on:
        MAX_FREE_IDS, or the pool's blocks when there are more (an admission may evict every one)."""
        return max(MAX_FREE_IDS, self.num_kv_blocks)

    @classmethod
    def of(cls, engine: Engine) -> StepLimits:
        config = engine.config
        return cls(
            tuple(engine.model_config.moe_layers),
            config.max_batch_tokens,
            config.max_batch_size,
            engine.model_config.vocab_size,
            engine.allocator.num_blocks,
        )

    def check(self, chunks, num_decodes: int, num_frees: int, num_evictions: int = 0) -> None:
        tokens = sum(len(c.token_ids) for c in chunks) + num_decodes
        if tokens > self.max_batch_tokens:
            raise InvalidRequestError("step", f"{tokens} tokens exceed max_batch_tokens {self.max_batch_tokens}")
        if len(chunks) + num_decodes > self.max_batch_size:
            raise InvalidRequestError(
                "step", f"{len(chunks) + num_decodes} sequences exceed max_batch_size {self.max_batch_size}"
            )
        if num_frees > MAX_FREE_IDS:
            raise InvalidRequestError("free_request_ids", f"{num_frees} ids, at most {MAX_FREE_IDS} per step")
        if num_evictions > self.max_block_ids:  # evicted and registered block ids together
            raise InvalidRequestError(
                "evict_block_ids",
                f"{num_evictions} ids and cache_sequence_blocks rows, at most {self.max_block_ids} per step",
            )
        for chunk in chunks:  # the engine checks the exact counts; this bounds what a hostile step makes it copy
            if (
                len(chunk.prefix_block_ids) > self.max_block_ids
                or len(chunk.cache_block_ids) > len(chunk.token_ids) + 1
                or len(chunk.prefix_token_ids) > self.max_batch_tokens * self.max_block_ids
            ):
                raise InvalidRequestError(
                    "prefix_block_ids", f"sequence {chunk.request_id}: too many prefix or cache block ids"
                )


@dataclass(frozen=True, slots=True)
class StepRequest:
    step_id: int
    free_ids: np.ndarray  # [n] uint64: sequences to free before the step
    chunks: list[PrefillInput]
    decode_ids: np.ndarray  # [m] uint64
    routing_plan: RoutingPlan | None
    masks: dict[int, np.ndarray] | None = None  # constrained sequences sampling here -> grammar mask words [W]
    evict_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, "<u8"))  # [k] uint64: cached prefix
    # blocks to drop, after the frees
    late_masks: dict[int, np.ndarray] | None = None  # late masks of the step sent before this one: sequence ->
    # words [W], applied to that step before this one launches
    # [r, 3] uint64: (sequence, block index, block id) of full blocks running sequences' decodes wrote, to cache
    sequence_blocks: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), "<u8"))
    refusal: str = ""  # why the message was refused before it became a step: only its frees and evictions run

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not len(self.decode_ids)

    def bookkeeping(self) -> StepRequest:
        """The step's frees and evictions alone: what still runs when the rest is refused (the router counts them
        as done whatever the answer, and never sends them again)."""
        return StepRequest(self.step_id, self.free_ids, [], np.zeros(0, "<u8"), None, evict_ids=self.evict_ids)


@dataclass
class StepAnswer:
    """What the model thread hands back for one step: a result, or why the whole step was refused."""

    step_id: int
    result: StepResult | None
    refused: str
    seconds: float
    kind: str = "decode"  # "prefill" when the step carried prompt chunks (the step-duration metric's label)
    capacity: bool = False  # refused for want of KV blocks (RESOURCE_EXHAUSTED), not as malformed


@dataclass
class _Launched:
    """A stream step the engine launched, waiting to be collected."""

    step_id: int
    in_flight: InFlightStep
    refused: list[SequenceOutput]  # its sequences refused before launch (foreign, draining)
    started: float
    kind: str


class StreamSession:
    """One router stream's sequences and its steps on the model thread (every method below runs there)."""

    def __init__(self, engine: Engine, owners: dict[int, int], draining=lambda: False, session_id: int | None = None):
        self.engine = engine
        self.id = next(_session_ids) if session_id is None else session_id
        self.owners = owners  # sequence id -> session id, shared by every session of the worker
        self.draining = draining  # () -> bool: new sequences are refused while it is true
        self._late_frees: list[int] = []  # freed by a step while an earlier one holding them was in flight

    def run(self, step: StepRequest) -> StepAnswer:
        launched = self.launch(step)
        return launched if isinstance(launched, StepAnswer) else self.collect(launched)

    def launch(
        self, step: StepRequest, held: frozenset[int] = frozenset(), final: bool = True
    ) -> StepAnswer | _Launched:
        """Frees, ownership checks, then the engine's launch: a _Launched to `collect`, or at once the
        outcome of a step that launched nothing (frees only, refused). held: sequences of a step still in
        flight; frees of those are only recorded (they stop being ours, a decode of them is UNKNOWN_SEQUENCE)
        until `release_late` runs after that step's collection, so it still samples them. final: a refusal is
        the step's answer (False: it is launched again, so its sequences have lost no chunk yet)."""
        started = time.perf_counter()
        late = {int(r) for r in step.free_ids if int(r) in held and self.owners.get(int(r)) == self.id}
        self._free(int(r) for r in step.free_ids if int(r) not in late)
        for r in late:
            del self.owners[r]
        self._late_frees += late
        for block_id in step.evict_ids.tolist():  # one held by a late-freed sequence returns with it
            self.engine.allocator.evict((self.id, block_id))
        if step.is_empty:
            try:
                self._register(self._sequence_blocks(step, [], []))
            except InvalidRequestError as e:
                return StepAnswer(step.step_id, None, str(e), time.perf_counter() - started, "free")
            return StepAnswer(step.step_id, None, "", time.perf_counter() - started, "free")
        assert not (late & {c.request_id for c in step.chunks}), "a chunk of a sequence freed late"
        refused = [SequenceOutput(r, error=FOREIGN_SEQUENCE) for r in self._foreign(step)]
        chunks = [c for c in step.chunks if self.owners.get(c.request_id, self.id) == self.id]
        if self.draining():
            live = self.engine.sequences
            refused += [SequenceOutput(c.request_id, error=DRAINING) for c in chunks if c.request_id not in live]
            chunks = [c for c in chunks if c.request_id in live]
        decodes_kept = [self.owners.get(r, self.id) == self.id for r in step.decode_ids.tolist()]
        decodes = [r for r, kept in zip(step.decode_ids.tolist(), decodes_kept) if kept]
        for chunk in chunks:
            self.owners.setdefault(chunk.request_id, self.id)
        kind = "prefill" if step.chunks else "decode"
        try:
            registrations = self._sequence_blocks(step, chunks, decodes, late)
            plan = step.routing_plan
            if plan is not None:  # the router's plan counts the tokens of the rows refused here too
                plan = plan.keep_chunk_rows(step.chunks, chunks, decodes_kept, self.engine.model_config.num_experts)
            masks = step.masks
            if masks and refused:  # a row refused here samples nothing: its mask goes with it
                gone = {out.request_id for out in refused}
                masks = {r: words for r, words in masks.items() if r not in gone}
            in_flight = self.engine.launch(chunks, decodes, plan, frozenset(late), masks, owner=self.id)
        except (InvalidRequestError, CapacityError) as e:
            self._forget_unknown(chunks)
            if final:
                self.engine.refused(chunks)
            return StepAnswer(
                step.step_id, None, str(e), time.perf_counter() - started, kind, isinstance(e, CapacityError)
            )
        self._register(registrations)  # after the step's own launch: no chunk of it starts on these blocks
        return _Launched(step.step_id, in_flight, refused, started, kind)

    def _sequence_blocks(
        self, step: StepRequest, chunks, decodes: list[int], late: Set[int] = frozenset()
    ) -> list[tuple[int, int, tuple[int, int]]]:
        """The step's registrations of full blocks its running sequences' decodes wrote (this step's included),
        checked before it launches. late: the sequences it frees while a step in flight holds them."""
        if not len(step.sequence_blocks):
            return []
        owns = lambda r: self.owners.get(r) == self.id  # noqa: E731
        # only the decodes that run write a position: one of a sequence still prefilling fills no block
        fed = dict.fromkeys((r for r in decodes if self.engine.runs_decode(r, late)), 1)
        return sequence_block_registrations(
            self.engine.allocator, self.engine.sequences, step.sequence_blocks, self.id, owns, fed, chunks
        )

    def _register(self, registrations: list[tuple[int, int, tuple[int, int]]]) -> None:
        for seq_id, index, key in registrations:
            self.engine.allocator.register(seq_id, index, key)

    def collect(self, launched: _Launched) -> StepAnswer:
        if launched.in_flight.late:  # their masks will not come (see StepPump): those rows fail, the rest stand
            log.warning("step %d: no late masks came for %d rows", launched.step_id, len(launched.in_flight.late))
            self.engine.fail_late_masks(launched.in_flight)
        result = self.engine.collect(launched.in_flight)
        for out in result.outputs:  # a failed sequence the engine still holds (a decode sent mid-prefill)
            if out.error and out.request_id not in self.engine.sequences:  # stays ours to free
                self.owners.pop(out.request_id, None)
        result.outputs += launched.refused
        return StepAnswer(launched.step_id, result, "", time.perf_counter() - launched.started, launched.kind)

    def close(self) -> None:
        """The stream ended: free every sequence it started and drop the blocks it cached."""
        self._free([r for r, owner in self.owners.items() if owner == self.id])
        self.engine.allocator.evict_owner(self.id)

    def _foreign(self, step: StepRequest) -> list[int]:
        ids = [c.request_id for c in step.chunks] + [int(r) for r in step.decode_ids]
        return [r for r in ids if self.owners.get(r, self.id) != self.id]

    def release_late(self) -> None:
        """Frees what `launch` recorded for a step in flight (call once that step is collected)."""
        late, self._late_frees = self._late_frees, []
        self.engine.release(late)

    def _free(self, request_ids) -> None:
        mine = [r for r in dict.fromkeys(request_ids) if self.owners.get(r) == self.id]  # named twice: freed once
        for r in mine:
            del self.owners[r]
        self.engine.release(mine)

    def _forget_unknown(self, chunks: list[PrefillInput]) -> None:
        """A refused step started nothing: drop ownership the engine never took up."""
        for chunk in chunks:
            if chunk.request_id not in self.engine.sequences:
                self.owners.pop(chunk.request_id, None)


class StepPump:
    """Runs one stream's steps on the model thread in arrival order, launching step t+1 before collecting step t
    whenever the engine allows it (every sampling row of t is the device's argmax, and launching t+1 does not
    wait for the device): the device runs t+1 while the host samples t, answers it and reads the router's next
    step, instead of idling between steps.

    Late masks: a step with greedy constrained rows whose masks come with the next message cannot be collected
    until that message arrives; the pump applies them first, then launches the message's own step, then collects
    the earlier one. It waits for them rather than step aside (LATE_MASKS_TIMEOUT_S at most); when they cannot
    come (the stream ends, the message carrying them is refused) those rows fail and the late masks of the next
    message are ignored.

    `submit` and `close` may be called from any thread. The steps run in one model-thread job (`_drain`) that
    lasts while steps keep coming; it ends when nothing is in flight and nothing waits, and after any step it
    steps aside (collects, then queues itself again) when other model-thread work waits, so heartbeats, unary
    calls and other streams are never starved. `close` goes through the same queue, after the stream's steps.
    Outcomes go to each step's future; a fault fails every future of the stream and is handed to `on_fault`
    (the worker's fatal path, which also covers a stream nobody awaits any more)."""

    def __init__(self, session: StreamSession, executor, on_fault=lambda error: None):
        self.session, self.executor, self.on_fault = session, executor, on_fault
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._draining = False
        self._ignore_late = False  # the message before did not run (refused) or its late masks were given up on

    def submit(self, step: StepRequest) -> concurrent.futures.Future:
        """Queues a step; one with a `refusal` (malformed) answers in order, after the steps before it, and the
        late masks it carried never come, which the step waiting for them learns then."""
        return self._put(step)

    def close(self) -> concurrent.futures.Future:
        """Frees every sequence the stream started, once the steps queued before have run."""
        return self._put(None)

    def _put(self, step: StepRequest | None) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_running_or_notify_cancel()  # a waiter that goes away cannot cancel it: the pump settles each one
        self._inbox.put((step, done))
        with self._lock:
            if not self._draining:
                self._draining = True
                self.executor.submit(self._drain)
        return done

    def _others_waiting(self) -> bool:
        waiting = getattr(self.executor, "has_waiting", None)
        return bool(waiting and waiting())

    def _progress(self) -> None:
        progress = getattr(self.executor, "progress", None)
        if progress is not None:  # the watchdog times each step, not the whole drain
            progress()

    def _next(self, pending: tuple[_Launched, concurrent.futures.Future] | None):
        """The next step to run, or None: nothing waits and nothing is in flight, the step in flight finished
        before another arrived, or other model-thread work is waiting."""
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            if pending is None:
                return None
        engine = self.session.engine
        if pending[0].in_flight.late:  # only the next message can finish it
            try:
                return self._inbox.get(timeout=LATE_MASKS_TIMEOUT_S)
            except queue.Empty:
                return None
        while True:
            try:
                return self._inbox.get(timeout=POLL_S)
            except queue.Empty:
                if engine.ready(pending[0].in_flight) or self._others_waiting():
                    return None

    def _collect(self, pending: tuple[_Launched, concurrent.futures.Future]) -> None:
        launched, done = pending
        self._ignore_late |= bool(launched.in_flight.late)  # given up on: masks still on their way are stale
        outcome = self.session.collect(launched)
        self.session.release_late()
        done.set_result(outcome)
        self._progress()

    def _must_collect_first(self, step: StepRequest, pending) -> bool:
        """Whether the step in flight is collected before `step` launches: the engine cannot run them both;
        `step` frees sequences of the one in flight and starts prompts (which may reuse those ids); it sends a
        chunk for a sequence the one in flight samples (what the engine makes of it depends on whether that
        sampling released the sequence, as non-finite logits do); or its launch would wait for the device (the
        one in flight would be answered only after it)."""
        engine = self.session.engine
        if not engine.can_launch:
            return True
        in_flight = pending[0].in_flight
        chunk_ids = {c.request_id for c in step.chunks}
        tokens = sum(len(c.token_ids) for c in step.chunks) + len(step.decode_ids)
        return bool(
            chunk_ids & (in_flight.sampling | (in_flight.sequences & set(step.free_ids.tolist())))
        ) or engine.blocks_host(tokens)

    def _step_aside(self, pending) -> bool:
        """Collects what is in flight and ends this job when other model-thread work waits; it is queued again
        behind that work if steps are left. Returns whether it stepped aside."""
        if not self._others_waiting() or (pending is not None and pending[0].in_flight.late):
            return False
        if pending is not None:
            self._collect(pending)
        with self._lock:
            if self._inbox.empty():
                self._draining = False
            else:
                self.executor.submit(self._drain)
        return True

    def _apply_late(self, step: StepRequest, pending) -> str:
        """Applies the message's late masks to the step in flight that waits for them; a refusal when they are
        wrong, or when masks come and no step waits (unless the one they were for did not run)."""
        masks, ignore, self._ignore_late = step.late_masks or {}, self._ignore_late, False
        in_flight = pending[0].in_flight if pending is not None else None
        if in_flight is not None and in_flight.late:
            try:
                self.session.engine.apply_late_masks(in_flight, masks, set(step.free_ids.tolist()))
            except InvalidRequestError as e:
                return str(e)
        elif masks and not ignore:
            return "late_token_masks: no step in flight waits for late masks"
        return ""

    def _answer(self, done: concurrent.futures.Future, answer: StepAnswer) -> None:
        self._ignore_late |= bool(answer.refused)  # late masks for a step that did not run have nothing to do
        done.set_result(answer)
        self._progress()

    def _drain(self) -> None:
        pending = None  # (_Launched, its future): launched, not collected
        current = None
        try:
            while True:
                current = self._next(pending)
                if current is None:
                    if pending is not None:
                        self._collect(pending)
                        pending = None
                    with self._lock:
                        if self._inbox.empty():
                            self._draining = False
                            return
                    if self._step_aside(None):
                        return
                    continue
                step, done = current
                if step is not None and (why := step.refusal or self._apply_late(step, pending)):
                    if pending is not None and (pending[0].in_flight.late or len(step.free_ids)):
                        self._collect(pending)  # its late rows fail; frees of its sequences take effect at once
                        pending = None
                    self.session.launch(step.bookkeeping())  # frees and evictions only: it launches nothing
                    self._answer(done, StepAnswer(step.step_id, None, why, 0.0))
                    current = None
                    continue
                if step is None or pending is not None and self._must_collect_first(step, pending):
                    if pending is not None:
                        self._collect(pending)
                        pending = None
                if step is None:  # the stream ended
                    self.session.close()
                    done.set_result(None)
                    current = None
                    continue
                held: frozenset[int] = pending[0].in_flight.sequences if pending else frozenset()
                launched = self.session.launch(step, held, final=pending is None)
                if isinstance(launched, StepAnswer) and launched.refused and pending is not None:
                    # judged again as it would be one step at a time: what the step in flight releases on
                    # collection (late frees, a sequence with non-finite logits) gives back KV blocks and batch
                    # rows, and a decode of a released sequence is no longer part of the batch
                    self._collect(pending)
                    pending = None
                    launched = self.session.launch(step)
                if isinstance(launched, StepAnswer):  # launched nothing (frees only, or refused)
                    if pending is not None:  # its late frees take effect now, not a step later
                        self._collect(pending)
                        pending = None
                    self._answer(done, launched)
                else:
                    if pending is not None:
                        self._collect(pending)
                    pending = (launched, done)
                current = None
                if self._step_aside(pending):
                    return
        except BaseException as e:  # a worker fault: every step of this stream waiting here gets it
            try:
                self.session.engine.abandon_in_flight()
                self.session.release_late()
            except Exception as cleanup:  # a broken device fails here too: the fault below is what matters
                log.warning("cleaning up after a worker fault failed: %s: %s", type(cleanup).__name__, cleanup)
            for failed in (pending, current):
                if failed is not None and not failed[1].done():
                    failed[1].set_exception(e)
            with self._lock:
                self._draining = False
                while True:
                    try:
                        _, done = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    done.set_exception(e)
            self.on_fault(e)
            raise
