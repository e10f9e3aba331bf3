"""Continuous-batching scheduler: pure Python, no grpc, no protobuf, no asyncio; the batching loop drives it
and `router_service.wire` converts its steps and outputs to and from the worker's messages.

Design note. There is one token-accounting model and no prefill/decode "phases": every request has
``num_tokens`` (prompt + generated) and ``num_computed_tokens`` (tokens whose KV the worker holds), and a
step is ``{request_id: tokens to run}``. A request still inside its prompt runs a chunk of it (chunked
prefill falls out of the token budget); a request past its prompt runs exactly one token, its last sampled
one. Running requests are served first, oldest first, so decodes never starve behind a long prompt; the
rest of the budget admits waiting requests in FIFO order, between steps.

KV admission reserves blocks for prompt + max_new_tokens when a request is admitted. The worker protocol has
no swap or preemption, so reserving the worst case is what lets an admitted request always finish; the cost
is a lower batch occupancy when max_new_tokens is generous. Admission stops at the first waiting request that
does not fit (head-of-line, as TGI), so a large request is not overtaken forever by small ones. Two worker
limits ride on the same rule, both max_batch_size: requests with penalties on the worker at once (it holds
that many state slots), and prompt tokens scored per step (prompt_logprobs rows copied to the host). A constrained
request (grammar masks) is sent a decode only once its previous token is back (its next mask depends on it), unless
its masks may come late (`late_masks`: plain greedy at pipeline depth 2): then its decode goes out with one token
pending, as an unconstrained one does, and its mask follows in the next message.

With prefix caching (router_service/prefix_cache.py) a request is admitted on the blocks of its prompt already
cached: it reserves only the rest, starts its prefill after them (its first chunk names them), and chunks
register the full blocks they complete, which later steps may start other requests on at once (the worker runs
steps in order); a request whose next block a running one is computing waits for it (skipped, keeping its
place) and starts on it in the step after the one writing it. Cached blocks no request holds are evicted,
least recently used first, only when an admission needs their room; the step carries the evictions.

Each step's message must also stay under the worker's receive limit (router_service/step_size.py): chunks are cut
to the bytes left, and a decode, chunk or admission that does not fit waits for the next step, as for tokens.

A request that leaves (finished or cancelled) returns its blocks at once; when the worker had already seen
it, the next scheduled step carries its id among the step's frees, which the worker runs before the step. A request cancelled while waiting is dropped from the queue and never reaches the worker.
"""

from __future__ import annotations

from collections import deque

from router_service.logprobs import Scored
from router_service.prefix_cache import UNKNOWN_PREFIX_BLOCK, PrefixCache, PrefixState
from router_service.scheduled import (  # re-exported: most of the router imports them from here
    Chunk,
    FinishReason,
    RequestOutput,
    ScheduledRequest,
    ScheduledStep,
    SchedulerLimits,
    Status,
)
from router_service.step_size import ID_BYTES, SEQUENCE_BLOCK_BYTES, StepRoom, StepSize


class Scheduler:
    def __init__(
        self, limits: SchedulerLimits, prefix_cache: PrefixCache | None = None, step_size: StepSize = StepSize()
    ):
        self.limits = limits
        self.prefix_cache = prefix_cache
        self.step_size = step_size  # the step message's byte budget (the worker's receive limit)
        self.waiting: deque[ScheduledRequest] = deque()
        self.running: list[ScheduledRequest] = []  # admission order
        self.requests: dict[int, ScheduledRequest] = {}
        self.num_free_blocks = limits.num_kv_blocks
        self._pending_free: set[int] = set()  # left while on the worker; next step filters them out
        self._scoring_budget = limits.max_batch_size  # prompt_logprobs tokens left in the step being scheduled

    # ---- requests in and out ----
    def add(self, req: ScheduledRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"scheduler: request {req.request_id} is already scheduled")
        if not req.prompt_ids or req.max_new_tokens < 1:
            raise ValueError("scheduler: a request needs a prompt and max_new_tokens >= 1")
        if not self.fits(req.num_prompt_tokens + req.max_new_tokens):
            raise ValueError(f"scheduler: request {req.request_id} needs more KV blocks than exist")
        if self.prefix_cache is not None:
            req.prefix = PrefixState(
                self.prefix_cache.hashes(req.prompt_ids, req.cache_salt, req.prompt_bytes),
                may_hit=not req.scores_prompt,
                may_claim=not req.scores_prompt,
            )
        req.status = Status.WAITING
        self.waiting.append(req)
        self.requests[req.request_id] = req

    def finish(self, request_id: int, reason: FinishReason) -> bool:
        """Removes a request (finished, cancelled, failed) and frees its blocks now; False if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
        # returned: detached cached blocks (failed registrations) it held last
        returned = self.prefix_cache.release(req.prefix) if self.prefix_cache and req.prefix else 0
        self.num_free_blocks += req.num_blocks + returned
        req.num_blocks = 0
        req.status, req.finish_reason = Status.FINISHED, req.finish_reason or reason
        if req.is_on_worker:
            self._pending_free.add(request_id)
        return True

    def clear(self) -> list[int]:
        """Forgets every request (the worker was lost); returns their ids."""
        ids = list(self.requests)
        self.waiting.clear()
        self.running.clear()
        self.requests.clear()
        self._pending_free.clear()
        self.num_free_blocks = self.limits.num_kv_blocks
        if self.prefix_cache is not None:
            self.prefix_cache = self.prefix_cache.cleared()
        return ids

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_used_blocks(self) -> int:
        """Blocks requests hold or reserve (cached blocks no request holds are free to evict, not used)."""
        evictable = self.prefix_cache.num_evictable_blocks if self.prefix_cache is not None else 0
        return self.limits.num_kv_blocks - self.num_free_blocks - evictable

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` (prompt + max_new_tokens) fits the KV pool at all."""
        return self.limits.blocks_for(num_tokens) <= self.limits.num_kv_blocks

    def _blocks_needed(self, req: ScheduledRequest) -> int:
        return self.limits.blocks_for(req.num_prompt_tokens + req.max_new_tokens)

    # ---- one step ----
    def schedule(self, now: float = 0.0, reserved_bytes: int = 0) -> ScheduledStep:
        """The next step; `reserved_bytes`: what its message carries besides the step (late grammar masks)."""
        expired = [s.request_id for s in self.waiting if s.queue_deadline <= now]
        for request_id in expired:
            self.finish(request_id, FinishReason.EXPIRED)
        if self.prefix_cache is not None:
            self.prefix_cache.begin_step()  # before any chunk: blocks this step writes are ready from the next
        budget = self.limits.max_batch_tokens
        queued_evictions = len(self.prefix_cache.pending_evictions) if self.prefix_cache is not None else 0
        carried = reserved_bytes + ID_BYTES * (len(self._pending_free) + queued_evictions)
        if carried > self.step_size.max_bytes:  # a burst of frees and evictions passes the limit on its own
            return self._release_step(tuple(expired), reserved_bytes)
        size = self.step_size
        room = size.room(carried)
        self._scoring_budget = self.limits.max_batch_size  # prompt_logprobs tokens this step
        scheduled: dict[int, int] = {}
        chunks: list[Chunk] = []
        decodes: list[int] = []
        decode_tokens: list[int] = []
        for req in self.running:
            if budget == 0 or len(scheduled) == self.limits.max_batch_size:
                break
            if req.is_prefilling:
                if req.scores_prompt and not self._scoring_budget:
                    continue
                budget -= self._fit_chunk(req, budget, room, scheduled, chunks)
            elif req.may_decode and room.take(size.decode_bytes(req), size.late_mask_bytes(req)):  # else: the next step
                scheduled[req.request_id] = 1
                decodes.append(req.request_id)
                # -1: the input token is still being sampled by a step in flight (the worker feeds its own copy)
                decode_tokens.append(req.output_ids[-1] if req.num_pending_outputs == 0 else -1)
                req.num_scheduled_tokens += 1
                req.num_pending_outputs += 1
                budget -= 1
        cache, deferred = self.prefix_cache, []
        while self.waiting and budget > 0 and len(scheduled) < self.limits.max_batch_size:
            req = self.waiting[0]
            hits = cache.lookup(req.prefix, req.num_prompt_tokens) if cache and req.prefix else 0
            if hits is None:  # a running request is computing its next block: it starts on that block instead
                deferred.append(self.waiting.popleft())
                continue
            hits = self.step_size.prefix_blocks_that_fit(req, hits)
            needed = self._blocks_needed(req) - hits
            shortfall = max(needed - self.num_free_blocks, 0)
            if (
                shortfall > (cache.evictable_beyond(req.prefix, hits) if cache and req.prefix else 0)
                or (req.scores_prompt and not self._scoring_budget)
                or (req.penalized and sum(r.penalized for r in self.running) >= self.limits.max_batch_size)
            ):
                break
            first = self._first_chunk_tokens(req, hits, budget, room, shortfall)
            if not first:
                if shortfall and cache and req.prefix:  # its evictions' ids may never fit one step with its chunk
                    self._evict_ahead(req, hits, shortfall, room)
                break
            self.waiting.popleft()
            if cache and req.prefix:
                cache.admit(req.prefix, hits, req.num_prompt_tokens, shortfall)
                self.num_free_blocks += shortfall
                req.num_cached_tokens = req.num_computed_tokens = req.num_scheduled_tokens = (
                    hits * self.limits.kv_block_size
                )
            self.num_free_blocks -= needed
            req.num_blocks, req.status = needed, Status.RUNNING
            self.running.append(req)
            budget -= self._fit_chunk(req, budget, room, scheduled, chunks, first)
        self.waiting.extendleft(reversed(deferred))
        free_ids = frozenset(self._pending_free)
        self._pending_free.clear()
        generated = self._cache_generated(room) if cache and cache.caches_generated else ()
        evictions = cache.take_evictions() if cache else ()
        steps = (tuple(chunks), tuple(decodes), tuple(decode_tokens))
        spent = self.step_size.max_bytes - room.left
        return ScheduledStep(scheduled, *steps, free_ids, tuple(expired), evictions, generated, spent)

    def _release_step(self, expired: tuple[int, ...], reserved_bytes: int) -> ScheduledStep:
        """A step of frees and evictions alone, as many as its bytes carry (frees first; the rest wait for the next
        steps): many requests gone at once can pass the limit by themselves. It runs nothing, so no work takes the
        worker's blocks before all of them are out."""
        n = max(self.step_size.max_bytes - reserved_bytes, 0) // ID_BYTES
        frees = frozenset(sorted(self._pending_free)[:n])
        self._pending_free -= frees
        evictions = self.prefix_cache.take_evictions(n - len(frees)) if self.prefix_cache is not None else ()
        spent = reserved_bytes + ID_BYTES * (len(frees) + len(evictions))
        return ScheduledStep({}, (), (), (), frees, expired, evictions, estimated_bytes=spent)

    def _evict_ahead(self, req: ScheduledRequest, hits: int, shortfall: int, room: StepRoom) -> None:
        """The head of the queue waits for its bytes while blocks must be evicted for its room: the step carries as
        many of those evictions as it has bytes for, so an admission needing more than one step's worth of ids is
        made over several (the queue behind it waits, as for its KV)."""
        assert self.prefix_cache is not None and req.prefix is not None
        evicted = self.prefix_cache.evict_ahead(req.prefix, hits, min(shortfall, max(room.left, 0) // ID_BYTES))
        room.take(ID_BYTES * evicted)
        self.num_free_blocks += evicted

    def _cache_generated(self, room: StepRoom) -> tuple[tuple[int, int, int], ...]:
        """Registrations of the blocks running requests filled: full of tokens back from the worker, their last
        position fed by a decode of this step or an earlier one (the worker registers them once it is launched).
        Those past the step's bytes wait for a later step."""
        cache, bs = self.prefix_cache, self.limits.kv_block_size
        out: list[tuple[int, int, int]] = []
        assert cache is not None
        for req in self.running:
            state = req.prefix
            if state is None or not state.may_claim or req.is_prefilling:
                continue
            for index in range(len(state.hashes), min(req.num_scheduled_tokens, req.num_tokens) // bs):
                if not room.take(SEQUENCE_BLOCK_BYTES):
                    return tuple(out)
                start, end, prompt = index * bs, (index + 1) * bs, req.num_prompt_tokens
                tokens = req.prompt_ids[start:prompt] + req.output_ids[max(start - prompt, 0) : end - prompt]
                block_id = cache.cache_generated(state, req.cache_salt, tokens)
                if block_id:
                    req.num_blocks -= 1  # moved from its reservation to the index
                    out.append((req.request_id, index, block_id))
        return tuple(out)

    def _first_chunk_tokens(self, req: ScheduledRequest, hits: int, budget: int, room: StepRoom, evicted: int) -> int:
        """How many tokens of a waiting request's first chunk (on `hits` cached blocks) fit the step's bytes beside
        the `evicted` blocks' ids, which are then spent; 0: not one, and it waits for the next step."""
        start, left = hits * self.limits.kv_block_size, room.left - ID_BYTES * evicted
        n = self.step_size.tokens_that_fit(req, start, True, hits, budget, left)
        if not n or not room.take(ID_BYTES * evicted):  # the evictions' ids: fit, as the chunk's check counted them
            return 0
        return n

    def _fit_chunk(
        self, req: ScheduledRequest, budget: int, room: StepRoom, scheduled: dict, chunks: list, fits: int = 0
    ) -> int:
        """Adds `req`'s next chunk, as long as the token budget and the step's bytes allow; 0: not a token fits.
        `fits`: the tokens that fit, when the admission's check just found them for this budget and room."""
        start, first = req.num_scheduled_tokens, not req.is_on_worker
        blocks = len(req.prefix.hit_ids) if first and req.prefix is not None else 0
        n = fits or self.step_size.tokens_that_fit(req, start, first, blocks, budget, room.left)
        if n == 0:
            return 0
        n = self._add_chunk(req, n, scheduled, chunks)
        room.take(self.step_size.chunk_bytes(req, start, n, first, blocks))
        return n

    def _add_chunk(self, req: ScheduledRequest, budget: int, scheduled: dict, chunks: list) -> int:
        start = req.num_scheduled_tokens
        n = min(req.num_prompt_tokens - start, budget)
        if req.scores_prompt:
            n = min(n, self._scoring_budget)
            self._scoring_budget -= n
        scheduled[req.request_id] = n
        is_last = start + n == req.num_prompt_tokens
        is_first, prefix = not req.is_on_worker, req.prefix
        cache_ids = self.prefix_cache.chunk_block_ids(prefix, start, n) if self.prefix_cache and prefix else ()
        prefix_tokens = tuple(req.prompt_ids[:start]) if is_first and req.sends_prefix_tokens else ()  # cached ones
        req.num_blocks -= sum(1 for block_id in cache_ids if block_id)  # moved from its reservation to the index
        chunks.append(
            Chunk(
                req.request_id,
                tuple(req.prompt_ids[start : start + n]),
                is_first=is_first,
                is_last=is_last,
                sampling=req.sampling if is_first else None,
                prefix_block_ids=tuple(prefix.hit_ids) if is_first and prefix else (),
                prefix_token_ids=prefix_tokens,
                cache_block_ids=cache_ids,
                start=start,
            )
        )
        req.num_scheduled_tokens += n
        req.num_pending_outputs += is_last
        req.is_on_worker = True
        return n

    def update(self, step: ScheduledStep, generations: list[RequestOutput]) -> list[RequestOutput]:
        """Applies a step's results; returns one output per request still known, with finish reasons.

        Requests that left while the step ran (cancelled) are skipped; `finish` already queued their ids among
        the next step's frees.
        """
        by_id = {g.request_id: g for g in generations}
        self._settle(step, by_id)
        outputs = []
        for request_id, n in step.num_scheduled_tokens.items():
            req = self.requests.get(request_id)
            if req is None:
                continue
            req.num_computed_tokens += n
            expects_token = req.num_computed_tokens >= req.num_prompt_tokens
            req.num_pending_outputs -= expects_token
            gen = by_id.get(request_id)
            if gen is None or gen.error:
                error = gen.error if gen is not None else "MISSING_GENERATION"
                self._failed_on_worker(req)
                self.finish(request_id, FinishReason.ERROR)
                outputs.append(RequestOutput(request_id, None, error=error, finish_reason=FinishReason.ERROR))
                continue
            if gen.prompt is not None:
                req.prompt_scores.append(gen.prompt)
            if gen.token_id is None:
                if expects_token:  # the prompt ended but the worker sampled nothing
                    self._failed_on_worker(req)
                    self.finish(request_id, FinishReason.ERROR)
                    outputs.append(
                        RequestOutput(request_id, None, error="NO_TOKEN_AFTER_PROMPT", finish_reason=FinishReason.ERROR)
                    )
                continue
            req.output_ids.append(gen.token_id)
            reason = self._stop_reason(req, gen.token_id)
            if reason is not None:
                self.finish(request_id, reason)
            prompt = Scored.concat(req.prompt_scores) if req.prompt_scores else None
            req.prompt_scores = []
            outputs.append(RequestOutput(request_id, gen.token_id, gen.logprob, reason, top=gen.top, prompt=prompt))
        return outputs

    def settle_empty(self, step: ScheduledStep, refused: bool) -> None:
        """A step that ran no tokens came back: the registrations it carried stand unless it was refused."""
        self._settle(step, {}, answered=not refused)

    def refused(self, step: ScheduledStep) -> None:
        """The worker refused the step as a whole: nothing it carried was cached, and the later chunks of its
        requests fail alone (the loop fails the requests next)."""
        self._settle(step, {}, answered=False)
        for request_id in step.num_scheduled_tokens:
            req = self.requests.get(request_id)
            if req is not None:
                self._failed_on_worker(req)

    def _failed_on_worker(self, req: ScheduledRequest) -> None:
        """The worker failed `req`'s sequence: the blocks its steps in flight register will not be written."""
        if self.prefix_cache is not None and req.prefix is not None:
            self.prefix_cache.failed(req.prefix)

    def _settle(self, step: ScheduledStep, by_id: dict[int, RequestOutput], answered: bool = True) -> None:
        """Blocks the step's chunks registered stay cached when their sequence ran unharmed; blocks it registered
        for running sequences (written by this step or earlier ones), unless the step was refused or the sequence failed;
        blocks a new sequence was refused on (UNKNOWN_PREFIX_BLOCK) leave the index when the worker lost them, and
        blocks a new sequence ran on count as prefix cache hits."""
        if self.prefix_cache is None:
            return
        for chunk in step.prefill_chunks:
            gen = by_id.get(chunk.request_id)
            if gen is not None and gen.error == UNKNOWN_PREFIX_BLOCK:  # stale: offered again, refused again
                self.num_free_blocks += self.prefix_cache.forget(chunk.prefix_block_ids)
            elif chunk.prefix_block_ids and gen is not None and not gen.error:
                self.prefix_cache.reused(len(chunk.prefix_block_ids))
            if any(chunk.cache_block_ids):
                ok = gen is not None and not gen.error
                self.num_free_blocks += self.prefix_cache.settle([b for b in chunk.cache_block_ids if b], ok)
        for request_id, _, block_id in step.sequence_blocks:
            gen = by_id.get(request_id)
            ok = answered and not (gen is not None and gen.error)
            self.num_free_blocks += self.prefix_cache.settle([block_id], ok)

    @staticmethod
    def _stop_reason(req: ScheduledRequest, token_id: int) -> FinishReason | None:
        # The worker suppresses these ids until min_new_tokens, so seeing one means it may stop here.
        if token_id in req.stop_token_ids:
            return FinishReason.STOP_TOKEN
        if token_id in req.eos_token_ids:
            return FinishReason.EOS
        if len(req.output_ids) >= req.max_new_tokens:
            return FinishReason.LENGTH
        return None
