"""The step budget's estimate against the real serialized message: random traffic through the real scheduler, two
steps in flight as the batching loop keeps them (late grammar masks riding in the next message), each step built by
the real wire serializer with its routing plan and masks. Every message is at most what the budget counted for it
plus the fixed framing allowance (the limit's sixteenth is not needed to cover anything), and never over the limit;
every request the budget accepted finishes. Also under limits that hold one grammar mask but not two, where a late
mask counted in both its decode's step and the next would halve a constrained request's steps."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from common.pb import worker_pb2 as pb
from common.routing_table import RoutingTable
from router_service import wire
from router_service.constraints import any_token_mask
from router_service.prefix_cache import UNKNOWN_PREFIX_BLOCK, PrefixCache
from router_service.routing import RoutingPlanner
from router_service.scheduler import FinishReason, RequestOutput, ScheduledRequest, Scheduler, SchedulerLimits
from router_service.step_size import FRAMING_BYTES, StepSize, framing_margin

ROUTER_LIMIT = 256 * 1024 * 1024
# A W3C trace context as the router's span writes it: its share of FRAMING_BYTES.
TRACEPARENT = {"traceparent": "00-" + "c" * 32 + "-" + "d" * 16 + "-01", "tracestate": "colibri=" + "e" * 64}


def _planner(rng, vocab: int) -> RoutingPlanner:
    layers, experts = int(rng.integers(1, 6)), int(rng.integers(2, 65))
    top_k = int(rng.integers(1, min(experts, 8) + 1))
    first = rng.integers(0, experts, (layers, vocab, 1))
    table = ((first + np.arange(top_k)) % experts).astype(np.uint16)  # distinct experts per token
    if rng.random() < 0.3:  # a gated table (router-gen --min-share): rows padded, the message no larger
        table[np.arange(top_k)[None, None, :] >= rng.integers(0, top_k + 1, (layers, vocab))[:, :, None]] = 0xFFFF
    return RoutingPlanner(RoutingTable(table, experts, sorted(rng.choice(64, layers, replace=False).tolist())))


def _sampling(rng, vocab: int, seed: int) -> pb.SamplingParams:
    big = rng.random() < 0.1
    bias = {int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, vocab, int(rng.integers(0, 400 if big else 8)))}
    stops = [int(t) for t in rng.integers(0, vocab, int(rng.integers(0, 40 if big else 3)))]
    params = pb.SamplingParams(seed=seed, logit_bias=bias, stop_token_ids=stops, temperature=float(rng.random()))
    if rng.random() < 0.3:
        params.repetition_penalty = 1.3
    return params


def one_mask_limit(mask_bytes: int, spare: float) -> int:
    """A limit whose budget (less the framing margin) is one mask and `spare` of another."""
    target = mask_bytes + int(spare * mask_bytes)
    limit = (target + FRAMING_BYTES) * 16 // 15
    while limit - framing_margin(limit) < target:
        limit += 1
    return limit


class Traffic:
    """Random requests (shared system prompts, penalties that send cached prefixes' tokens, prompt logprobs, grammar
        masks early and late, n > 1 copies) through one scheduler, stepped at pipeline depth 2 (1 with a routing plan,
    as the batching loop keeps it: a plan needs every decode's input token)."""

    def __init__(self, seed: int, one_mask: bool = False):
        self.rng = rng = np.random.default_rng(seed)
        self.vocab = int(rng.choice([40, 300, 32000, 152064, int(rng.integers(2, 260000))]))
        block = int(rng.choice([1, 2, 4, 16, 32]))
        planner = _planner(rng, self.vocab) if rng.random() < 0.5 else None
        self.limit = int(rng.choice([4096, 8192, 32768, 200_000, 1 << 20]))
        if one_mask:  # depth 2 (no plan), masks of KiBs, and a step that holds one of them and part of another
            planner, self.vocab = None, int(rng.choice([32000, 152064, int(rng.integers(40000, 260000))]))
            self.limit = one_mask_limit(
                StepSize.of(0, ROUTER_LIMIT, self.vocab, block).mask_bytes, rng.uniform(0.3, 0.9)
            )
        self.planner = planner
        self.depth = 1 if planner is not None else 2
        self.size = StepSize.of(self.limit, ROUTER_LIMIT, self.vocab, block, planner)
        assert not one_mask or self.size.mask_bytes <= self.size.max_bytes < 2 * self.size.mask_bytes
        limits = SchedulerLimits(
            int(rng.integers(1, 48)), int(rng.integers(1, 4096)), block, int(rng.integers(64, 600))
        )
        cache = PrefixCache(block, b"m", caches_generated=bool(rng.random() < 0.5)) if rng.random() < 0.8 else None
        self.scheduler = Scheduler(limits, cache, self.size)
        self.systems = [self._tokens(int(rng.integers(1, 400))) for _ in range(3)]
        self.next_id = int(rng.choice([1, 1 << 40, (1 << 63) - 100_000]))  # varint lengths of request ids
        self.late: set[int] = set()  # constrained requests whose masks may come late
        self.constrained: set[int] = set()
        self.admitted: set[int] = set()

    def _tokens(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(0, self.vocab, n)]

    def arrive(self) -> None:
        rng, s = self.rng, self.scheduler
        tail = self._tokens(int(rng.integers(1, 300)))
        prompt = (self.systems[int(rng.integers(0, 3))] + tail) if rng.random() < 0.7 else tail
        max_new = int(rng.integers(1, 12))
        if not s.fits(len(prompt) + max_new):
            return
        constrained, scores = bool(rng.random() < 0.3), bool(rng.random() < 0.15)
        late = constrained and self.depth == 2 and bool(rng.random() < 0.6)
        base = _sampling(rng, self.vocab, 0)
        for copy in range(int(rng.choice([1, 1, 1, 2, 4]))):  # n > 1: one sequence each, seeds apart
            sampling = pb.SamplingParams()
            sampling.CopyFrom(base)
            sampling.seed = int(rng.integers(0, 1 << 63)) + copy
            penalised = sampling.HasField("repetition_penalty") or bool(rng.random() < 0.1)
            rid, self.next_id = self.next_id, self.next_id + 1
            req = ScheduledRequest(
                rid,
                list(prompt),
                max_new,
                eos_token_ids=frozenset({0}),
                sampling=sampling,
                sampling_bytes=sampling.ByteSize(),
                penalized=penalised,
                sends_prefix_tokens=penalised,
                scores_prompt=scores,
                constrained=constrained,
                late_masks=late,
            )
            if self.size.problem(req) is not None:
                continue
            s.add(req)
            self.admitted.add(rid)
            self.constrained |= {rid} if constrained else set()
            self.late |= {rid} if late else set()

    def message(self, step, step_id: int, late_before: tuple[int, ...]) -> tuple[pb.StepStreamRequest, tuple]:
        """The step as the pipeline sends it, and the constrained decodes whose masks go with the next message."""
        live = self.scheduler.requests
        mask = any_token_mask(self.vocab)
        late_ids = tuple(
            d for d, t in zip(step.decode_ids, step.decode_token_ids) if t < 0 and d in self.constrained and d in live
        )
        sampling = [c.request_id for c in step.prefill_chunks if c.is_last] + list(step.decode_ids)
        masks = {r: mask for r in sampling if r in self.constrained and r not in late_ids}
        late_masks = {r: mask for r in late_before if r in live} or None
        plan = self.planner.routing_plan(step) if self.planner is not None and not step.is_empty else None
        message = wire.step_request(step, step_id, plan, masks, late_masks)
        message.trace_context.update(TRACEPARENT)
        return message, late_ids

    def answer(self, step) -> None:
        rng, outputs = self.rng, []
        for chunk in step.prefill_chunks:
            error = UNKNOWN_PREFIX_BLOCK if chunk.prefix_block_ids and rng.random() < 0.05 else ""
            token = int(rng.integers(0, self.vocab)) if chunk.is_last and not error else None
            outputs.append(RequestOutput(chunk.request_id, token, error=error))
        outputs += [RequestOutput(d, int(rng.integers(0, self.vocab))) for d in step.decode_ids]
        self.scheduler.update(step, outputs)

    def cancel_burst(self) -> None:
        """Many requests leave at once (clients gone): their frees, and the blocks they held, ride the next step."""
        ids = list(self.scheduler.requests)
        for rid in ids[: int(self.rng.integers(0, len(ids) + 1))]:
            self.scheduler.finish(rid, FinishReason.CANCELLED)


@pytest.mark.parametrize("seed", range(24))
def test_no_step_message_is_larger_than_its_estimate(seed):
    run_traffic(Traffic(seed))


@pytest.mark.parametrize("seed", range(12))
def test_no_step_message_is_larger_than_its_estimate_when_the_limit_holds_one_mask(seed):
    run_traffic(Traffic(seed, one_mask=True))


def test_a_late_mask_is_counted_in_one_step_only():
    """A greedy constrained request at depth 2 under a limit that holds one mask: each decode's mask rides the next
    message beside that message's own decode (whose mask rides the one after), so its max_new_tokens take the
    prompt's step, one step a token after it, and a last message for the last decode's mask (counted twice, a
    decode could not share a message with a late mask and ran every other step)."""
    vocab, max_new = 152064, 12
    size = StepSize.of(one_mask_limit(StepSize.of(0, ROUTER_LIMIT, vocab, 16).mask_bytes, 0.5), ROUTER_LIMIT, vocab, 16)
    s = Scheduler(SchedulerLimits(8, 512, 16, 64), None, size)
    sampling = pb.SamplingParams(seed=1)
    s.add(ScheduledRequest(7, [5] * 10, max_new, sampling=sampling, sampling_bytes=sampling.ByteSize(),
                           constrained=True, late_masks=True))  # fmt: skip
    mask, in_flight, late_before, sent = any_token_mask(vocab), collections.deque(), (), 0
    while s.requests or late_before:
        while len(in_flight) < 2:
            step = s.schedule(0.0, len(late_before) * size.mask_bytes)
            if step.is_empty and not late_before:
                break
            late_ids = tuple(d for d, t in zip(step.decode_ids, step.decode_token_ids) if t < 0)
            sampling_ids = [c.request_id for c in step.prefill_chunks if c.is_last] + list(step.decode_ids)
            masks = {r: mask for r in sampling_ids if r not in late_ids}
            late = {r: mask for r in late_before if r in s.requests} or None
            sent += 1
            message = wire.step_request(step, sent, None, masks, late)
            message.trace_context.update(TRACEPARENT)
            assert message.ByteSize() <= min(step.estimated_bytes + FRAMING_BYTES, size.limit)
            in_flight.append(step)
            late_before = late_ids
            if step.is_empty:
                break
        step = in_flight.popleft()
        s.update(
            step, [RequestOutput(r, 9) for r in [c.request_id for c in step.prefill_chunks] + list(step.decode_ids)]
        )
        if not in_flight:
            late_before = ()
    assert sent == max_new + 1


def run_traffic(t: Traffic) -> None:
    """Steps `t` at its pipeline depth until every request finished, checking each message's size."""
    in_flight: collections.deque = collections.deque()
    late_before: tuple[int, ...] = ()
    step_ids = iter(range(1, 1 << 30))
    for tick in range(4000):
        if tick < 150:
            for _ in range(int(t.rng.integers(0, 4))):
                t.arrive()
            if t.rng.random() < 0.03:
                t.cancel_burst()
        while len(in_flight) < t.depth:
            step = t.scheduler.schedule(0.0, len(late_before) * t.size.mask_bytes)
            carries = step.free_ids or step.evict_block_ids or step.sequence_blocks or late_before
            if step.is_empty and not carries:
                break
            message, late_ids = t.message(step, next(step_ids), late_before)
            size = message.ByteSize()
            assert size <= step.estimated_bytes + FRAMING_BYTES, (size, step.estimated_bytes)
            assert size <= t.limit
            in_flight.append(step)
            late_before = late_ids
            if step.is_empty:
                break
        if in_flight:
            t.answer(in_flight.popleft())
            if not in_flight:
                late_before = ()  # nothing in flight waits for a mask
        elif tick >= 150 and not t.scheduler.requests:
            return
    raise AssertionError(f"{len(t.scheduler.requests)} requests never finished")
