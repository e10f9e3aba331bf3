"""A property test of prefix caching at the scheduler's level: the real router Scheduler and PrefixCache against a
model of the worker built on the real BlockAllocator that also records what each pool block holds (the tokens at
its rows and the cache salt of the request that wrote them).

Each case draws a pool size, batch limits and a pipeline depth of 1-3 (steps scheduled before earlier ones are
answered), then random traffic: prompts cut from a few shared system prompts (on and off block boundaries), one-token
prompts, next turns resending a finished request's prompt and answer (so they start on generated blocks), two salts,
penalties, prompt log-probabilities, cancels and router-side errors, sequence errors, and steps the worker refuses
as a whole (the loop then fails their requests, and later chunks of those sequences fail alone on the worker).

It checks that:
- a sequence starts only on cached blocks holding exactly its own prompt's tokens, written under its salt, and is
  refused a prefix only when the worker never registered a block of it (named by a refused step, by a chunk that
  failed alone, or a decoded block a refusal left short);
- no registered block, and no block of another sequence, is ever written;
- the tokens the router feeds (chunks, a penalised request's prefix tokens, decode inputs) are the worker's;
- the router's blocks add up after every answered step (free + reserved + cached = the pool);
- once the traffic stops, both sides hold the same cached blocks, no sequence holds any, and the rest is free.

Seeds are fresh each run; a failure names its seed, and COLIBRI_FUZZ_SEED=N replays that one case.
"""

from __future__ import annotations

import collections
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from common.kv_blocks import blocks_needed
from expert_service.engine.kv_cache import BlockAllocator
from router_service.prefix_cache import PrefixCache
from router_service.scheduler import (
    Chunk,
    FinishReason,
    RequestOutput,
    ScheduledRequest,
    ScheduledStep,
    Scheduler,
    SchedulerLimits,
)
from tests.router_service.test_prefix_cache import BLOCK

NUM_CASES = 400  # about 6 s here
STEPS = 250  # of traffic per case, then a drain
VOCAB = 30  # small, so prompts and answers repeat and share blocks
REFUSE_RATE, ERROR_RATE = 0.04, 0.03


@dataclass(frozen=True)
class Sent:
    """What a client sent: the model's ground truth for the request, independent of the scheduler's copy."""

    prompt: list[int]
    salt: str
    penalized: bool
    repetition: bool  # a repetition penalty, which counts the prompt: its cached prefix's tokens are sent


@dataclass
class PoolBlock:
    """What one pool block holds: the salt of the sequence that wrote it and its tokens, row by row."""

    salt: str
    tokens: list[int]
    writer: int | None  # the sequence that may still write it; None once registered (read-only from then on)


@dataclass
class Coverage:
    """How often the events worth fuzzing happened, so a run that never reaches them fails."""

    hit_blocks: int = 0
    generated_hits: int = 0
    refused_steps: int = 0
    failed_alone: int = 0
    unknown_prefix: collections.Counter[str] = field(default_factory=collections.Counter)  # why the block was missing


class ContentWorker:
    """The worker's pool as the step stream drives it, like tests/router_service/test_prefix_cache.py's WorkerModel,
    but remembering what every block holds, so a sequence started on a cached block can be checked against its own
    prompt. It runs a step as the engine does: frees and evictions first, then chunks and decodes (a chunk of a
    sequence it does not hold at the chunk's start, or a decode of one with no sampled token, fails alone), then the
    step's registrations. It samples random tokens and fails chunks at random (sequence errors)."""

    def __init__(self, num_blocks: int, coverage: Coverage):
        self.pool = BlockAllocator(num_blocks, BLOCK)
        self.blocks: dict[int, PoolBlock] = {}  # pool block -> its contents, from its last allocation
        self.fed: dict[int, list[int]] = {}  # sequence -> the tokens whose KV it holds, by position
        self.salts: dict[int, str] = {}
        self.last_sampled: dict[int, int] = {}  # sequence -> its last sampled token (a decode's input)
        # Ids the router named that were never registered, and why: a refused step's, a chunk's that failed alone, a
        # decoded block a refused step left short.
        self.never_registered: dict[int, str] = {}
        self.short: set[int] = set()  # sequences with a chunk or decode in a refused step
        self.generated_ids: set[int] = set()  # ids of decoded blocks (cache_sequence_blocks)
        self.coverage = coverage

    def _free_and_evict(self, step: ScheduledStep) -> None:
        """What the worker does before any step, refused or not."""
        for rid in step.free_ids:
            self.pool.free(rid)
            self.fed.pop(rid, None)
            self.last_sampled.pop(rid, None)
        for block_id in step.evict_block_ids:
            self.pool.evict((0, block_id))

    def _write(self, rid: int, tokens: tuple[int, ...] | list[int]) -> None:
        """Writes a sequence's next tokens into its table: only into blocks it was handed fresh and not registered."""
        fed = self.fed[rid]
        old = len(self.pool.tables.get(rid, []))
        table = self.pool.ensure_capacity(rid, len(fed) + len(tokens))  # CapacityError: the router over-admitted
        for block in table[old:]:
            self.blocks[block] = PoolBlock(self.salts[rid], [], rid)
        for token in tokens:
            contents = self.blocks[table[len(fed) // BLOCK]]
            assert contents.writer == rid, f"sequence {rid} writes a block that is registered or not its own"
            assert len(contents.tokens) == len(fed) % BLOCK
            contents.tokens.append(token)
            fed.append(token)

    def _register(self, rid: int, index: int, block_id: int) -> None:
        """Registers a full block of the sequence; from now on nobody writes it."""
        block = self.pool.tables[rid][index]
        assert len(self.blocks[block].tokens) == BLOCK, f"block {block_id} registered before it was full"
        assert self.pool.register(rid, index, (0, block_id)), f"block id {block_id} taken or the block has another"
        self.blocks[block].writer = None

    def _start(self, chunk: Chunk, sent: Sent) -> bool:
        """Starts a sequence on its cached blocks; False (it fails alone) when one of them is not registered."""
        rid, keys = chunk.request_id, [(0, b) for b in chunk.prefix_block_ids]
        missing = {key[1] for key in keys if key not in self.pool.cached}
        assert missing <= self.never_registered.keys(), f"sequence {rid} starts on blocks {missing} never offered"
        if missing:
            self.coverage.unknown_prefix.update(self.never_registered[b] for b in missing)
            return False
        assert chunk.start == len(keys) * BLOCK
        want_prefix = tuple(sent.prompt[: chunk.start]) if sent.repetition else ()
        assert chunk.prefix_token_ids == want_prefix, f"sequence {rid}: wrong prefix tokens for its penalties"
        if keys:
            self.pool.attach(rid, keys)
        self.salts[rid], self.fed[rid] = sent.salt, []
        for index, block_id in enumerate(chunk.prefix_block_ids):
            contents = self.blocks[self.pool.cached[(0, block_id)]]
            assert contents.salt == sent.salt, f"sequence {rid} starts on block {block_id} of another salt"
            assert contents.tokens == sent.prompt[index * BLOCK : (index + 1) * BLOCK], (
                f"sequence {rid} starts on block {block_id}, which holds other tokens than its prompt's"
            )
            self.fed[rid] += contents.tokens
        self.coverage.hit_blocks += len(keys)
        self.coverage.generated_hits += bool(self.generated_ids & set(chunk.prefix_block_ids))
        return True

    def run(
        self, step: ScheduledStep, sent: dict[int, Sent], rng: random.Random, error_rate: float
    ) -> list[RequestOutput]:
        """Runs a step the worker accepted; returns its answer."""
        self._free_and_evict(step)
        out: list[RequestOutput] = []
        registrations: list[tuple[int, int, int]] = []
        for chunk in step.prefill_chunks:
            rid = chunk.request_id
            if chunk.is_first and not self._start(chunk, sent[rid]):
                out.append(RequestOutput(rid, None, error="UNKNOWN_PREFIX_BLOCK"))
                self._not_registered(chunk.cache_block_ids, "chunk on a missing prefix")
                continue
            if not chunk.is_first and len(self.fed.get(rid, ())) != chunk.start:  # behind a refused chunk
                out.append(RequestOutput(rid, None, error="UNKNOWN_SEQUENCE"))
                self._not_registered(chunk.cache_block_ids, "chunk failed alone")
                self.coverage.failed_alone += 1
                continue
            assert chunk.token_ids == tuple(sent[rid].prompt[chunk.start : chunk.start + len(chunk.token_ids)])
            self._write(rid, chunk.token_ids)
            first = chunk.start // BLOCK
            registrations += [(rid, i, b) for i, b in enumerate(chunk.cache_block_ids, first) if b]
            failed = rng.random() < error_rate
            token = rng.randrange(VOCAB) if chunk.is_last and not failed else None
            if token is not None:
                self.last_sampled[rid] = token
            out.append(RequestOutput(rid, token, error="BOOM" if failed else ""))
        for rid, token in zip(step.decode_ids, step.decode_token_ids):
            if rid not in self.last_sampled:  # never started, or its prompt's last chunk failed
                out.append(RequestOutput(rid, None, error="UNKNOWN_SEQUENCE"))
                continue
            if token != -1:  # -1: sampled by a step in flight, the worker feeds its own copy
                assert token == self.last_sampled[rid], f"sequence {rid} fed {token}, sampled {self.last_sampled[rid]}"
            self._write(rid, [self.last_sampled[rid]])
            self.last_sampled[rid] = rng.randrange(VOCAB)
            out.append(RequestOutput(rid, self.last_sampled[rid]))
        for rid, index, block_id in registrations:
            self._register(rid, index, block_id)
        for rid, index, block_id in step.sequence_blocks:
            self.generated_ids.add(block_id)
            if rid not in self.last_sampled:  # never started: its decodes failed alone too
                self._not_registered([block_id], "sequence unknown")
            elif rid in self.short and index >= len(self.fed[rid]) // BLOCK:  # skipped, as the engine does
                self._not_registered([block_id], "decoded block left short")
            else:
                self._register(rid, index, block_id)
        return out

    def refuse(self, step: ScheduledStep) -> None:
        """Refuses a step as a whole after its frees and evictions: nothing in it runs or is registered."""
        self._free_and_evict(step)
        for chunk in step.prefill_chunks:
            self._not_registered(chunk.cache_block_ids, "step refused")
        self._not_registered([block_id for _, _, block_id in step.sequence_blocks], "step refused")
        self.short |= set(step.num_scheduled_tokens)
        self.coverage.refused_steps += 1

    def _not_registered(self, block_ids: Iterable[int], why: str) -> None:
        """Remembers ids the router named that the worker did not register (0: no block)."""
        self.never_registered.update((block_id, why) for block_id in block_ids if block_id)


class Traffic:
    """Random requests: next turns of finished ones, one-token prompts, and cuts of shared system prompts."""

    def __init__(self, rng: random.Random, num_blocks: int):
        self.rng, self.num_blocks = rng, num_blocks
        self.systems = [[rng.randrange(VOCAB) for _ in range(n)] for n in (4, 7, 8, 13)]  # on and off boundaries
        self.sent: dict[int, Sent] = {}
        self.outputs: dict[int, list[int]] = collections.defaultdict(list)
        self.finished: list[tuple[list[int], str]] = []  # (prompt + answer, salt) of requests that ended well
        self.ids = iter(range(1, 10**6))

    def add(self, scheduler: Scheduler) -> None:
        """Sends 0-2 new requests."""
        rng = self.rng
        for _ in range(rng.choice([0, 0, 1, 2])):
            roll = rng.random()
            if self.finished and roll < 0.4:
                history, salt = rng.choice(self.finished)
                prompt = history + [rng.randrange(VOCAB) for _ in range(rng.randrange(3))]
            elif roll < 0.5:
                prompt, salt = [rng.randrange(VOCAB)], rng.choice(["", "x"])
            else:
                tail = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 1, 4]))]
                prompt, salt = rng.choice(self.systems)[: rng.randrange(1, 14)] + tail, rng.choice(["", "", "x"])
            max_new_tokens = rng.randrange(1, 9)
            if blocks_needed(len(prompt) + max_new_tokens, BLOCK) > self.num_blocks:
                continue  # more than the pool: the scheduler refuses it at once
            rid, penalized, scored = next(self.ids), rng.random() < 0.1, rng.random() < 0.1
            repetition = penalized and rng.random() < 0.5  # else presence/frequency only
            self.sent[rid] = Sent(prompt, salt, penalized, repetition)
            scheduler.add(
                ScheduledRequest(
                    rid,
                    list(prompt),
                    max_new_tokens,
                    cache_salt=salt,
                    penalized=penalized,
                    sends_prefix_tokens=repetition,
                    scores_prompt=scored,
                )
            )

    def record(self, outputs: list[RequestOutput]) -> None:
        """Keeps the tokens each request got, and the conversations that ended well for next turns."""
        for output in outputs:
            if output.token_id is not None:
                self.outputs[output.request_id].append(output.token_id)
            if output.finish_reason is not None and output.finish_reason is not FinishReason.ERROR:
                sent = self.sent[output.request_id]
                self.finished.append((sent.prompt + self.outputs[output.request_id], sent.salt))


def check_accounting(scheduler: Scheduler) -> None:
    """The router's blocks add up: free, reserved by running requests, and held by the cache make the pool."""
    cache = scheduler.prefix_cache
    assert cache is not None
    assert scheduler.num_free_blocks >= 0, f"{scheduler.num_free_blocks} free blocks"
    reserved = sum(r.num_blocks for r in scheduler.running)
    assert scheduler.num_free_blocks + reserved + cache.num_cached_blocks == scheduler.limits.num_kv_blocks


def run_case(seed: int, coverage: Coverage) -> None:
    """One seeded run of random traffic through a pipelined scheduler and the worker model, then a drain."""
    rng = random.Random(seed)
    num_blocks, depth = rng.choice([16, 24, 40]), rng.choice([1, 2, 3])
    limits = SchedulerLimits(rng.choice([2, 4, 6]), rng.choice([3, 5, 12]), BLOCK, num_blocks)
    scheduler = Scheduler(limits, PrefixCache(BLOCK, b"model", caches_generated=True))
    worker, traffic = ContentWorker(num_blocks, coverage), Traffic(rng, num_blocks)

    def answer(step: ScheduledStep, refuse_rate: float, error_rate: float) -> None:
        if not step.is_empty and rng.random() < refuse_rate:
            worker.refuse(step)
            scheduler.refused(step)
            for rid in step.num_scheduled_tokens:  # as the batching loop does
                scheduler.finish(rid, FinishReason.ERROR)
        elif step.is_empty:
            worker.run(step, traffic.sent, rng, 0.0)
            scheduler.settle_empty(step, False)
        else:
            traffic.record(scheduler.update(step, worker.run(step, traffic.sent, rng, error_rate)))
        check_accounting(scheduler)

    in_flight: collections.deque[ScheduledStep] = collections.deque()
    for _ in range(STEPS):
        traffic.add(scheduler)
        if scheduler.requests and rng.random() < 0.1:
            reason = rng.choice([FinishReason.CANCELLED, FinishReason.ERROR])
            scheduler.finish(rng.choice(list(scheduler.requests)), reason)
        in_flight.append(scheduler.schedule())
        if len(in_flight) == depth:
            answer(in_flight.popleft(), REFUSE_RATE, ERROR_RATE)
    while in_flight or scheduler.requests:  # drain: no new traffic, refusals or errors
        if not in_flight:
            in_flight.append(scheduler.schedule())
        step = in_flight.popleft()
        answer(step, 0.0, 0.0)
        if scheduler.requests or step.free_ids or step.evict_block_ids:
            in_flight.append(scheduler.schedule())
    worker.run(scheduler.schedule(), traffic.sent, rng, 0.0)  # the last frees and evictions

    cache = scheduler.prefix_cache
    assert cache is not None
    assert worker.pool.num_used_blocks == 0 and scheduler.num_used_blocks == 0, "blocks still held after the drain"
    router_cached, worker_cached = {b.block_id for b in cache.blocks.values()}, {key[1] for key in worker.pool.cached}
    assert router_cached == worker_cached, "the router's cached blocks (left) are not the worker's"
    assert worker.pool.num_free_blocks == scheduler.num_free_blocks == num_blocks - cache.num_cached_blocks, "free"


def case_seeds() -> list[int]:
    """COLIBRI_FUZZ_SEED=N replays one case; otherwise NUM_CASES consecutive seeds from a fresh base."""
    replay = os.environ.get("COLIBRI_FUZZ_SEED")
    if replay:
        return [int(replay)]
    base = random.SystemRandom().randrange(2**32)
    return list(range(base, base + NUM_CASES))


def test_random_pipelined_traffic_shares_only_blocks_holding_the_same_tokens_and_salt():
    seeds, coverage = case_seeds(), Coverage()
    for seed in seeds:
        try:
            run_case(seed, coverage)
        except Exception as error:  # an allocator error (over-admission, a stale id) fails the case too
            raise AssertionError(
                f"seed {seed} (replay: COLIBRI_FUZZ_SEED={seed}): {type(error).__name__}: {error}"
            ) from error
    if len(seeds) > 1:  # the traffic reached what it is meant to exercise
        assert coverage.hit_blocks and coverage.generated_hits, f"seeds {seeds[0]}..{seeds[-1]}: {coverage}"
        assert coverage.refused_steps and coverage.failed_alone, f"seeds {seeds[0]}..{seeds[-1]}: {coverage}"
        assert coverage.unknown_prefix, f"seeds {seeds[0]}..{seeds[-1]}: {coverage}"
