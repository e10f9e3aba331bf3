"""The worker's engine: sequences, the paged KV cache, one forward pass per step, and sampling.

It holds no request policy: the router decides which tokens run in a step (prompt chunks and decodes
mixed) and when a sequence ends; the engine keeps each sequence's KV blocks and sampler between steps,
keyed by the router's request id, until told to free it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Collection, Mapping, Sequence, Set
from dataclasses import replace

import numpy as np

from common.errors import CapacityError, InvalidRequestError, NonFiniteLogitsError
from common.model_format import ModelDir
from common.routing_plan import RoutingPlan
from expert_service.engine.chunk_positions import check_first_position, follows_missed_chunk, mark_missed
from expert_service.engine.config import EngineConfig, RoutingMode
from expert_service.engine.forward_batch import build_batch
from expert_service.engine.kv_cache import BlockAllocator
from expert_service.engine.logprobs import StepScores
from expert_service.engine.penalties import PenaltySlots
from expert_service.engine.prefix_blocks import (
    attach_prefix,
    cache_registrations,
    check_prefix_scoring,
    prefix_penalty_tokens,
)
from expert_service.engine.records import InFlightStep, SequenceOutput, SequenceState, StepResult
from expert_service.engine.sampling import Sampler, SamplingParams
from expert_service.engine.step import Decoder, HostLogits, Logits, PrefillInput, StepTrace
from expert_service.engine.token_masks import ALL_ALLOWED, step_masks, with_late_masks
from expert_service.experts.routing_plan import routing_plan_recall, table_recall

log = logging.getLogger("colibri.worker")

NON_FINITE_LOGITS = "NON_FINITE_LOGITS"
UNKNOWN_SEQUENCE = "UNKNOWN_SEQUENCE"
UNKNOWN_PREFIX_BLOCK = "UNKNOWN_PREFIX_BLOCK"
EARLIER_CHUNK_REFUSED = "EARLIER_CHUNK_REFUSED"
MISSING_TOKEN_MASK = "MISSING_TOKEN_MASK"  # a late mask never came (engine.fail_late_masks): the sequence is freed
# the worker's own plan lookup is scored on one step in this many: 50-500 us of host time a step otherwise
OWN_PLAN_RECALL_EVERY = 8


class Engine:
    """Sequences, their KV blocks and samplers over a compute backend built for the same model and config
    (``expert_service.backends.build_engine`` builds both)."""

    def __init__(self, model: ModelDir, config: EngineConfig, decoder: Decoder):
        self.model = model
        self.config = config
        self.model_config = model.config
        self.decoder = decoder
        self.slot_plan = decoder.slot_plan
        self.backend = self.decoder.backend
        self.allocator = BlockAllocator(config.resolved_num_kv_blocks, config.kv_block_size)
        self.sequences: dict[int, SequenceState] = {}
        self.penalty_slots = PenaltySlots(config.max_batch_size)  # the backends hold as many state slots
        self._in_flight: collections.deque[InFlightStep] = collections.deque()  # launched, not collected
        self._serials = itertools.count()

    def warmup(self) -> None:
        """Backend start-up work that must not happen while serving (CUDA: compile kernels, capture graphs)."""
        self.decoder.warmup()

    def close(self) -> None:
        """Releases the backend (device memory, pinned ranges, copy threads); the engine is unusable after."""
        self.decoder.close()

    # --- sequence lifecycle -------------------------------------------------------------------------
    def release(self, request_ids) -> list[int]:
        freed = []
        for rid in request_ids:
            if self.sequences.pop(rid, None) is not None:
                freed.append(rid)
            self.allocator.free(rid)
            self.penalty_slots.release(rid)
        return freed

    def keep_only(self, keep_ids) -> list[int]:
        keep = set(keep_ids)
        return self.release([rid for rid in list(self.sequences) if rid not in keep])

    def clear(self, keep_owners: Collection[int] = ()) -> int:
        """Frees every sequence and drops the cached blocks of every owner but `keep_owners` (open step streams,
        whose routers still offer their blocks); returns how many sequences were freed."""
        freed = len(self.release(list(self.sequences)))
        for owner in {key[0] for key in self.allocator.cached} - set(keep_owners):
            self.allocator.evict_owner(owner)
        return freed

    # --- steps --------------------------------------------------------------------------------------
    def step(
        self,
        prefill: Sequence[PrefillInput] = (),
        decode_ids: Sequence[int] = (),
        routing_plan: RoutingPlan | None = None,
    ) -> StepResult:
        """Runs prompt chunks and decodes in one forward pass; samples where a sequence wants a token.
        `routing_plan` (per MoE layer, expert -> step token indices, tokens in prompt-chunk-then-decode order)
        is the routing when routing=lut, and a prediction whose recall is measured otherwise."""
        return self.collect(self.launch(prefill, decode_ids, routing_plan))

    @property
    def can_launch(self) -> bool:
        """Whether `launch` may run now: nothing is in flight, or one step whose every sampling row is the
        device's argmax (its successor's decodes read their tokens there, nothing else of it is needed)."""
        flight = self._in_flight
        return not flight or (len(flight) == 1 and flight[0].overlappable and not flight[0].late)

    def runs_decode(self, request_id: int, freed: Set[int] = frozenset()) -> bool:
        """Whether a decode of the sequence launched now (with launch's `freed`) runs: it has a token to feed. A
        sequence still prefilling has none: its decode fails alone."""
        ahead = self._in_flight[0].serial if self._in_flight else None
        return self._decode_feed(request_id, freed, ahead) is not None

    def _decode_feed(self, request_id: int, freed: Set[int], ahead: int | None) -> tuple[str, int] | None:
        """Where a decode launched behind step `ahead` takes its token: ("pending", the row of that step whose
        sample it is, taken on the device), ("last", its last sampled token), or None (freed, unknown, or still
        prefilling)."""
        seq = None if request_id in freed else self.sequences.get(request_id)
        if seq is not None and seq.pending is not None and seq.pending[0] == ahead:
            return "pending", seq.pending[1]
        return ("last", seq.last_token) if seq is not None and seq.last_token is not None else None

    def blocks_host(self, num_tokens: int) -> bool:
        """Whether launching a step of this many tokens waits for the device inside the pass."""
        return self.decoder.blocks_host(num_tokens)

    def abandon_in_flight(self) -> None:
        """Forgets the launched, uncollected steps after a fault (the worker stops after one): their sequences'
        next tokens are unknown, and a later launch does not wait for them."""
        for step in self._in_flight:
            for seq in step.states:
                if seq.pending is not None and seq.pending[0] == step.serial:
                    seq.pending = None
        self._in_flight.clear()
        self.decoder.abandon()

    def refused(self, prefill: Sequence[PrefillInput]) -> None:
        """The step carrying these chunks was refused as a whole and is not launched again: the sequences held
        among them lost a chunk, and their next chunks may be on the way already (chunk_positions)."""
        mark_missed(self.sequences, prefill)

    def ready(self, step: InFlightStep) -> bool:
        """Whether `collect(step)` would return without waiting for the device (never while late masks wait)."""
        return step.launched is None or (not step.late and self.decoder.ready(step.launched))

    def apply_late_masks(self, step: InFlightStep, masks: Mapping[int, np.ndarray], freed: Set[int]) -> None:
        """Gives a launched step the masks of its late rows (request id -> words [W] uint32) and queues their
        application and the masked argmax, which a step launched next reads as its decodes' input. Every late row
        needs one but those of `freed` sequences (freed meanwhile: a late stop), and those released since launch;
        nothing changes when the masks are refused."""
        excused = {rid for rid in step.late if rid in freed or self.sequences.get(rid) is None}
        assert step.token_masks is not None  # a step with late rows has masks
        full = with_late_masks(step.token_masks, step.late, masks, excused, self.model_config.vocab_size)
        step.launched, step.late = self.decoder.complete(step.launched, full), {}

    def fail_late_masks(self, step: InFlightStep) -> None:
        """The late masks will not come (the stream ended, the next message was refused, or they were too late):
        the step completes unconstrained and its late rows are answered MISSING_TOKEN_MASK (their sequences are
        freed: the router's grammar never saw their token)."""
        assert step.token_masks is not None  # a step with late rows has masks
        full = step.token_masks.copy()
        full[list(step.late.values())] = ALL_ALLOWED
        step.failed = frozenset(step.late)
        step.launched, step.late = self.decoder.complete(step.launched, full), {}

    def launch(
        self,
        prefill: Sequence[PrefillInput] = (),
        decode_ids: Sequence[int] = (),
        routing_plan: RoutingPlan | None = None,
        freed: frozenset[int] = frozenset(),
        masks: Mapping[int, np.ndarray] | None = None,
        owner: int = 0,
    ) -> InFlightStep:
        """Validates and starts a step (see `step`); `collect` finishes it. While the step before is still in
        flight (`can_launch`), a decode whose last token that step samples takes it on the device. A step's
        sequences advance at launch (cached tokens, KV blocks), so the next step can be built at once.
        freed: sequences this step's caller has freed but releases only once the step in flight is collected
        (it still samples them); a decode of one is UNKNOWN_SEQUENCE, in its place, as if already released.
        masks: request id -> grammar mask words [W] uint32 of each constrained sequence sampling in this step
        (exactly those: one missing or one too many refuses the step).
        owner: whose prefix-cache block ids the chunks name (the caller's stream)."""
        if not self.can_launch:
            raise RuntimeError("a step is in flight that must be collected before another is launched")
        ahead = self._in_flight[0].serial if self._in_flight else None
        mc = self.model_config
        work: list[tuple[int, np.ndarray, bool]] = []
        created: list[int] = []  # a refused step starts nothing: these are dropped again
        running: list[PrefillInput] = []  # the chunks that run (the others fail alone)
        unknown = []  # freed (a late stop, a cancel, an error) or never started: that sequence alone fails
        fed: dict[int, int] = {}  # work index -> the row of the step in flight whose argmax is its token
        try:
            for chunk in prefill:
                seq = self.sequences.get(chunk.request_id)
                if seq is None:
                    if chunk.sampling is None:
                        if chunk.start_position:  # its first chunk never ran: refused with its step, or failed
                            unknown.append(SequenceOutput(chunk.request_id, error=UNKNOWN_SEQUENCE))
                            continue
                        raise InvalidRequestError(
                            "sampling",
                            f"sequence {chunk.request_id} is new: its first chunk must carry sampling parameters",
                        )
                    chunk.sampling.check_vocabulary(self.model_config.vocab_size)
                    check_first_position(chunk, self.config.kv_block_size)
                    check_prefix_scoring(chunk)
                    try:
                        num_cached = attach_prefix(self.allocator, chunk, owner)
                    except KeyError as missing:  # the router's view is stale: this sequence alone fails
                        log.warning("sequence %d: prefix block %d is not cached", chunk.request_id, missing.args[0])
                        unknown.append(SequenceOutput(chunk.request_id, error=UNKNOWN_PREFIX_BLOCK))
                        continue
                    self.sequences[chunk.request_id] = SequenceState(Sampler(chunk.sampling), num_cached=num_cached)
                    created.append(chunk.request_id)
                elif chunk.prefix_block_ids:
                    raise InvalidRequestError(
                        "prefix_block_ids", f"sequence {chunk.request_id}: only a first chunk may name cached blocks"
                    )
                elif follows_missed_chunk(seq, chunk):
                    unknown.append(SequenceOutput(chunk.request_id, error=EARLIER_CHUNK_REFUSED))
                    continue
                else:
                    seq.missed_chunk = False  # whole again (a refusal below marks it anew)
                work.append((chunk.request_id, np.asarray(chunk.token_ids, dtype=np.int64), chunk.is_last))
                running.append(chunk)
            first_decode = len(work)
            decodes_run: list[bool] = []  # per decode id: whether it has a token to feed
            for rid in decode_ids:
                feed = self._decode_feed(rid, freed, ahead)
                if feed is not None and feed[0] == "pending":
                    fed[len(work)] = feed[1]
                    work.append((rid, np.zeros(1, dtype=np.int64), True))
                elif feed is not None:
                    work.append((rid, np.array([feed[1]], dtype=np.int64), True))
                else:
                    unknown.append(SequenceOutput(rid, error=UNKNOWN_SEQUENCE))
                    decodes_run.append(False)
                    continue
                decodes_run.append(True)
            if not work:
                return InFlightStep(-1, [], [], unknown, (), set(), None, StepTrace(), time.perf_counter(), None, True)
            if routing_plan is not None:
                routing_plan = routing_plan.keep_chunk_rows(prefill, running, decodes_run, mc.num_experts)
            sampling = [rid for rid, _, wants_token in work if wants_token]
            constrained = [self.sequences[rid].sampler.params.constrained for rid in sampling]
            token_masks, late = step_masks(
                sampling,
                constrained,
                masks or {},
                {out.request_id for out in unknown},
                self.model_config.vocab_size,
                self._deferrable(work[first_decode:]) if any(constrained) else frozenset(),
            )
            token_ids = self._check_step(work)
            registrations = cache_registrations(self.allocator, self.sequences, running, owner)
            scored = self._scored_prompts(work[:first_decode])
            prefix_tokens = prefix_penalty_tokens(running, created, self.model_config.vocab_size, self.allocator)
            penalties = self._penalties(work, first_decode, created, prefix_tokens)
            lut = self.config.routing is RoutingMode.LUT
            # under exact routing the plan is a prediction, which a router table may make wider than the top-k
            top_k = mc.num_experts_per_tok if lut else None
            planned_ids = (
                routing_plan.expert_ids(mc.num_experts, len(token_ids), top_k, mc.moe_layers)
                if routing_plan is not None
                else None
            )
            if lut and not planned_ids:
                raise InvalidRequestError(
                    "routing_plan",
                    "routing=lut needs a routing plan with every step (start the router with --routing-table)",
                )
        except (InvalidRequestError, CapacityError):
            self.release(created)
            raise
        for rid, index, key in registrations:  # the step writes these blocks' KV before any later step reads them
            self.allocator.register(rid, index, key)
        batch = replace(
            build_batch(
                work, token_ids, self.sequences, self.allocator.tables, self.config.kv_block_size, scored=scored
            ),
            penalties=penalties,
            token_masks=token_masks,
            masks_late=bool(late),
        )
        if fed:
            rows = np.full(len(token_ids), -1, np.int32)
            rows[batch.seq_starts[list(fed)]] = list(fed.values())
            batch = replace(batch, fed_rows=rows)
        if planned_ids:
            batch = replace(
                batch,
                expert_hints=planned_ids,
                routed_experts=planned_ids if self.config.routing is RoutingMode.LUT else None,
            )
        assert not any(work[j][0] in self.penalty_slots.slots for j in fed), "a penalised decode fed on the device"
        states = [self.sequences[rid] for rid, _, _ in work]
        started = time.perf_counter()
        launched = self.decoder.launch(batch, traced=True)
        serial, row = next(self._serials), 0
        for (_, tokens, wants_token), seq in zip(work, states):
            seq.num_cached += len(tokens)
            if wants_token:
                seq.pending, row = (serial, row), row + 1
        overlappable = (
            self.decoder.supports_overlap
            and penalties is None
            and not scored
            and all(
                seq.sampler.plain_greedy and not seq.sampler.params.logprobs
                for (_, _, wants_token), seq in zip(work, states)
                if wants_token
            )
        )
        step = InFlightStep(
            serial,
            work,
            states,
            unknown,
            tuple(decode_ids),
            scored,
            planned_ids,
            StepTrace(),
            started,
            launched,
            overlappable,
            late,
            token_masks,
            fed=frozenset(fed),
        )
        self._in_flight.append(step)
        return step

    def collect(self, step: InFlightStep) -> StepResult:
        """Waits for a launched step and samples it: its StepResult. Steps are collected in launch order."""
        if step.launched is None:  # nothing ran: every decode named an unknown sequence
            return StepResult(step.unknown, 0.0, 0.0, step.trace, None, HostLogits(np.zeros((0, 0), np.float32)))
        if not self._in_flight or self._in_flight[0] is not step:
            raise RuntimeError("steps are collected in the order they were launched")
        if step.late:
            raise RuntimeError("a step is collected before its late masks were applied (or failed)")
        self._in_flight.popleft()
        logits = self.decoder.finish(step.launched, step.trace)
        t1 = time.perf_counter()
        recall = self._plan_recall(step)
        outputs, gone = self._sample(step, logits)
        if step.failed:
            outputs = [
                SequenceOutput(o.request_id, error=MISSING_TOKEN_MASK) if o.request_id in step.failed else o
                for o in outputs
            ]
            self.release(step.failed)
        unknown = step.unknown
        if gone:  # released since launch (non-finite logits in the step before): answered as if unknown at launch
            decodes = set(step.decode_ids)  # the chunks' failures come first, as they did at launch
            ids = {*gone, *(out.request_id for out in unknown if out.request_id in decodes)}
            unknown = [out for out in unknown if out.request_id not in decodes] + [
                SequenceOutput(rid, error=UNKNOWN_SEQUENCE)
                for rid in [*step.decode_ids, *(r for r in gone if r not in decodes)]
                if rid in ids
            ]
        outputs += unknown
        t2 = time.perf_counter()
        return StepResult(
            outputs, (t1 - step.started) * 1e3, (t2 - t1) * 1e3, step.trace, recall, logits, step.trace.expert_cache
        )

    def _plan_recall(self, step: InFlightStep) -> float | None:
        """routing=exact: the share of the step's exact routing its plan predicted: the decoder's own table lookup
        when its prefetch reads one (on one step in OWN_PLAN_RECALL_EVERY), else the router's plan when one came."""
        exact, table = step.trace.expert_ids, self.decoder.plan_lookup
        if self.config.routing is not RoutingMode.EXACT or not exact:
            return None
        if table is not None:
            return table_recall(table, step.input_tokens(), exact) if step.serial % OWN_PLAN_RECALL_EVERY == 0 else None
        return routing_plan_recall(step.planned_ids, exact) if step.planned_ids else None

    def _deferrable(self, decodes: list[tuple[int, np.ndarray, bool]]) -> set[int]:
        """Decodes whose mask may come late: plain greedy constrained ones, fed the device's masked argmax."""
        slots = self.penalty_slots.slots
        return {
            rid
            for rid, _, _ in decodes
            if (s := self.sequences[rid].sampler).params.constrained
            and s.plain_greedy
            and not s.params.logprobs
            and rid not in slots
        }

    def _scored_prompts(self, chunks: list[tuple[int, np.ndarray, bool]]) -> set[int]:
        """The sequences whose prompt chunk this step scores (prompt_logprobs): every position of the chunk
        becomes a logits row, at most max_batch_size of them per step (they are copied to the host)."""
        scored = {rid for rid, _, _ in chunks if self.sequences[rid].sampler.params.prompt_logprobs is not None}
        rows = sum(len(tokens) for rid, tokens, _ in chunks if rid in scored)
        if rows > self.config.max_batch_size:
            raise InvalidRequestError(
                "prompt_logprobs",
                f"{rows} prompt tokens to score in one step, at most max_batch_size ({self.config.max_batch_size})",
            )
        return scored

    def _penalties(self, work, first_decode: int, created: list[int], prefix_tokens: dict[int, np.ndarray]):
        """The step's PenaltyBatch (None when no penalised sequence takes part): new penalised sequences take a
        state slot; prompt chunks mark their tokens; a decode counts its input token, the one it sampled last."""
        builder = self.penalty_slots.builder()
        for rid in created:
            if self.sequences[rid].sampler.params.penalties.active:
                builder.reset(self.penalty_slots.acquire(rid))
        if not self.penalty_slots.slots:
            return None
        for rid, tokens in prefix_tokens.items():  # the cached prefix's tokens count as the prompt's others do
            builder.prompt(rid, tokens)
        for index, (rid, tokens, _) in enumerate(work):
            if index < first_decode:
                if self.sequences[rid].sampler.params.penalties.counts_prompt:
                    builder.prompt(rid, tokens)
            else:
                builder.output(rid, int(tokens[0]))
        for rid, _, wants_token in work:
            if wants_token:
                builder.row(rid, self.sequences[rid].sampler.params.penalties)
        return builder.build()

    def _sample(self, step: InFlightStep, logits: Logits) -> tuple[list[SequenceOutput], list[int]]:
        """A token for every sequence that wants one (rows in work order), then the step's log-probabilities:
        sampled tokens' and scored prompt chunks' (their rows follow the sampling rows); and the sequences
        released while the step was in flight (their rows are skipped, they get no output here)."""
        tokens_out: list[int | None] = []
        row, sequences, work, scored = 0, self.sequences, step.work, step.scored
        scores = StepScores(self.model_config.vocab_size)
        gone = set()
        for index, ((rid, _, wants_token), seq) in enumerate(zip(work, step.states)):
            if seq.pending is not None and seq.pending[0] == step.serial:
                seq.pending = None
            if sequences.get(rid) is not seq:
                gone.add(index)
            if not wants_token or index in gone:
                tokens_out.append(None)
                row += wants_token
                continue
            if seq.sampler.plain_greedy:
                argmax, finite = logits.greedy(row)
                sampled = seq.sampler.take_greedy(argmax) if finite else None
            else:
                sampled = seq.sampler.sample(logits[row], logits.processed(row))
            if sampled is not None and seq.sampler.params.logprobs:
                scores.sampled(index, row, sampled, seq.sampler.params.top_logprobs)
            tokens_out.append(sampled)
            row += 1
        for index, ((rid, tokens, wants_token), seq) in enumerate(zip(work, step.states) if scored else ()):
            top_k = seq.sampler.params.prompt_logprobs
            if rid in scored and top_k is not None:
                n = len(tokens) - 1  # the chunk's last position scores what follows
                scores.prompt(index, np.arange(row, row + n), seq.prompt_row, tokens, top_k)
                seq.prompt_row = None if wants_token else logits[row + n].copy()
                row += n + (not wants_token)
        sampled_scores, prompt_scores = scores.run(logits) if scores else ({}, {})
        outputs = []
        for index, ((rid, _, wants_token), token, seq) in enumerate(zip(work, tokens_out, step.states)):
            if index in gone:
                continue
            if wants_token and token is None:
                outputs.append(SequenceOutput(rid, error=NON_FINITE_LOGITS))
                self.release([rid])
                continue
            top = sampled_scores.get(index) if sampled_scores else None
            if token is not None:
                seq.last_token = token
            outputs.append(
                SequenceOutput(
                    rid,
                    token,
                    float(top.logprobs[0]) if top is not None else 0.0,
                    top=top if top is not None and top.top_ids.shape[1] else None,
                    prompt=prompt_scores.get(index) if prompt_scores else None,
                )
            )
        return outputs, [rid for index, (rid, _, _) in enumerate(work) if index in gone]

    def _check_step(self, work: list[tuple[int, np.ndarray, bool]]) -> np.ndarray:
        """Validates the step (the vocabulary check vectorised: decode steps are many one-token chunks),
        then grows each sequence's block table; returns the step's token ids, concatenated."""
        vocab, limit = self.model_config.vocab_size, self.model_config.max_position_embeddings
        total = sum(len(t) for _, t, _ in work)
        if total > self.config.max_batch_tokens:
            raise InvalidRequestError("step", f"{total} tokens exceed max_batch_tokens {self.config.max_batch_tokens}")
        if len(work) > self.config.max_batch_size:
            raise InvalidRequestError(
                "step", f"{len(work)} sequences exceed max_batch_size {self.config.max_batch_size}"
            )
        seen = set()
        for rid, tokens, _ in work:
            if rid in seen:
                raise InvalidRequestError("request_id", f"sequence {rid} appears twice in one step")
            seen.add(rid)
            if tokens.size == 0:
                raise InvalidRequestError("token_ids", f"sequence {rid}: empty chunk")
            if self.sequences[rid].num_cached + len(tokens) > limit:
                raise InvalidRequestError(
                    "token_ids",
                    f"sequence {rid}: {self.sequences[rid].num_cached + len(tokens)}"
                    f" tokens exceed max_position_embeddings {limit}",
                )
        token_ids = np.concatenate([t for _, t, _ in work])
        if token_ids.min() < 0 or token_ids.max() >= vocab:
            rid = next(r for r, t, _ in work if t.min() < 0 or t.max() >= vocab)
            raise InvalidRequestError("token_ids", f"sequence {rid}: ids must be in [0, {vocab})")
        tables, block_size = self.allocator.tables, self.config.kv_block_size
        for rid, tokens, _ in work:
            needed = self.sequences[rid].num_cached + len(tokens)
            table = tables.get(rid)
            if table is None or len(table) * block_size < needed:  # most decodes fit the last block
                self.allocator.ensure_capacity(rid, needed)
        return token_ids

    # --- offline helpers (CLI `logits` / `complete`, parity tests) -----------------------------------
    def prompt_logits(self, token_ids, request_id: int = -1) -> np.ndarray:
        """Float32 logits [n, V] at every prompt position, in one prefill; frees the sequence after."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        self.sequences[request_id] = SequenceState(Sampler(SamplingParams()))
        try:
            work = [(request_id, tokens, True)]
            token_ids = self._check_step(work)
            return np.stack(
                list(
                    self.decoder.forward(
                        build_batch(
                            work,
                            token_ids,
                            self.sequences,
                            self.allocator.tables,
                            self.config.kv_block_size,
                            all_logits=True,
                        )
                    )
                )
            )
        finally:
            self.release([request_id])

    def generate(
        self,
        token_ids,
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        stop_token_ids=(),
        request_id: int = -1,
    ) -> tuple[list[int], list[float], str]:
        """Prefill then decode one sequence; returns (new ids, logprobs, stop reason: length|stop)."""
        tokens: list[int] = []
        logprobs: list[float] = []
        out = self.step([PrefillInput(request_id, np.asarray(token_ids), sampling, True)]).outputs[0]
        try:
            while True:
                if out.error or out.token_id is None:
                    raise NonFiniteLogitsError(f"the model produced non-finite logits ({out.error})")
                tokens.append(out.token_id)
                logprobs.append(out.logprob)
                if out.token_id in stop_token_ids:
                    return tokens, logprobs, "stop"
                if len(tokens) >= max_new_tokens:
                    return tokens, logprobs, "length"
                out = self.step(decode_ids=[request_id]).outputs[0]
        finally:
            self.release([request_id])
