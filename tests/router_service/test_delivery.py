"""One worker output into its request's Delta or error: worker errors, grammar failures and completion, the metrics
hook seeing the request before its counters move, log-probabilities only when asked."""

from __future__ import annotations

import logging

import numpy as np

from common.errors import InvalidRequestError
from common.pb import router_pb2 as rpb
from router_service import errors
from router_service.config import RouterConfig
from router_service.constraints import GrammarError
from router_service.delivery import output_delta, split_for_late_masks
from router_service.errors import GenerationFailed, Unavailable
from router_service.request_state import Delta, RequestState
from router_service.scheduler import FinishReason, RequestOutput
from router_service.validation import ModelLimits, validate_request

LIMITS = ModelLimits(vocab_size=258, max_sequence_length=64, kv_capacity_tokens=1000)


def state(logprobs: bool = False, matcher=None, seq_id: int = 1) -> RequestState:
    params = rpb.SamplingParameters(max_new_tokens=8, logprobs=logprobs)
    req = validate_request(
        rpb.GenerateRequest(token_ids=rpb.TokenIds(ids=[5, 6]), parameters=params), RouterConfig(), LIMITS
    )
    return RequestState(seq_id, f"r{seq_id}", req, deadline=1e12, matcher=matcher)


class Matcher:
    """A grammar that accepts `allowed` and is complete after `length` tokens."""

    def __init__(self, allowed, length: int, outside_mask: bool = True):
        self.allowed, self.length, self.outside_mask, self.consumed = set(allowed), length, outside_mask, []

    def consume(self, token: int) -> None:
        if token not in self.allowed:
            raise GrammarError(f"token {token} refused", outside_mask=self.outside_mask)
        self.consumed.append(token)

    @property
    def is_stopped(self) -> bool:
        return len(self.consumed) >= self.length


def test_worker_errors_end_the_request():
    seen = []
    draining = output_delta(state(), RequestOutput(1, None, error="DRAINING"), lambda *a: seen.append(a))
    failed = output_delta(state(), RequestOutput(1, None, error="NON_FINITE_LOGITS"), lambda *a: seen.append(a))
    assert isinstance(draining, Unavailable) and draining.reason == "DRAINING"
    assert isinstance(failed, GenerationFailed) and "NON_FINITE_LOGITS" in str(failed)
    assert not seen  # no token was produced


def test_tokens_count_after_the_hook_and_logprobs_only_when_asked():
    rng = np.random.default_rng()
    for logprobs in (False, True):
        s, seen = state(logprobs), []
        hook = seen.append
        tokens = rng.integers(0, 258, 5).tolist()
        for n, token in enumerate(tokens):
            lp = float(rng.standard_normal())
            delta = output_delta(
                s, RequestOutput(1, token, lp), lambda st, now, hook=hook: hook((st.num_generated, now))
            )
            assert isinstance(delta, Delta) and delta.token_ids == [token] and delta.finish_reason is None
            assert delta.logprobs == ([lp] if logprobs else [])
            assert seen[-1][0] == n and s.num_generated == n + 1 and s.last_token_at == seen[-1][1]


def test_the_grammar_consumes_each_token_and_ends_the_request_when_complete():
    matcher = Matcher(allowed=range(10, 20), length=3)
    s = state(matcher=matcher)
    deltas = [output_delta(s, RequestOutput(1, t), lambda *a: None) for t in (11, 12, 13)]
    assert matcher.consumed == [11, 12, 13]
    assert [d.finish_reason for d in deltas] == [None, None, FinishReason.CONSTRAINT]


def test_a_token_the_grammar_refuses_fails_the_request():
    outside = output_delta(state(matcher=Matcher([1], 3)), RequestOutput(1, 7), lambda *a: None)
    limits = output_delta(state(matcher=Matcher([1], 3, outside_mask=False)), RequestOutput(1, 7), lambda *a: None)
    s = state(matcher=Matcher([7], 3))
    s.grammar_error = "mask failed"
    earlier = output_delta(s, RequestOutput(1, 7), lambda *a: None)
    assert isinstance(outside, GenerationFailed) and outside.reason == "CONSTRAINT"
    assert isinstance(limits, InvalidRequestError) and limits.field == "parameters.constraint"
    assert isinstance(earlier, InvalidRequestError) and "mask failed" in str(earlier)


def test_with_late_masks_due_every_grammar_advances_now_and_the_rest_waits_for_the_send():
    """Constrained requests take their token into the grammar at once (the next message's masks are computed from
    it); their Delta waits, as an unconstrained one's does, unless the request ends here (a finish, a completed
    grammar, a worker error: delivered now, so that message frees it and asks no mask for it) or its grammar
    fails. Without late masks due nothing is held back or advanced early."""
    going, ending, refusing = Matcher({7}, 5), Matcher({8}, 1), Matcher({1}, 5)
    requests = {i: state(matcher=m, seq_id=i) for i, m in [(1, going), (2, ending), (3, refusing), (4, None)]}
    requests[5] = state(matcher=Matcher({9}, 5), seq_id=5)
    requests[7] = state(seq_id=7)
    outputs = [
        RequestOutput(1, 7),
        RequestOutput(2, 8),
        RequestOutput(3, 9),
        RequestOutput(4, 10),
        RequestOutput(5, None, error="NON_FINITE_LOGITS"),
        RequestOutput(6, 11),  # a request gone meanwhile
        RequestOutput(7, 12, finish_reason=FinishReason.LENGTH),  # unconstrained, ends here
    ]
    now, later, failed = split_for_late_masks(outputs, requests, late_masks_due=True)
    assert [(o.request_id, advanced) for o, advanced in now] == [(2, True), (5, False), (6, False), (7, False)]
    assert [(o.request_id, advanced) for o, advanced in later] == [(1, True), (4, False)]
    assert [(seq_id, type(e)) for seq_id, e in failed] == [(3, GenerationFailed)]
    assert going.consumed == [7] and ending.consumed == [8] and not requests[5].matcher.consumed
    delta = output_delta(requests[1], outputs[0], lambda *a: None, grammar_advanced=True)
    assert isinstance(delta, Delta) and going.consumed == [7]  # not consumed twice

    again = {i: state(matcher=Matcher({7}, 5), seq_id=i) for i in (1,)}
    now, later, failed = split_for_late_masks([RequestOutput(1, 7)], again, late_masks_due=False)
    assert [(o.request_id, a) for o, a in now] == [(1, False)] and not later and not failed
    assert again[1].matcher.consumed == []


def test_a_failed_grammar_logs_no_token_id_and_a_client_cannot_flood_the_log(caplog):
    """Completion token ids are never logged: not in the delivery's own line, nor in the INTERNAL error the gRPC
    front logs. A grammar past its limits is the client's doing, so its line is rate-limited."""
    token = 4242
    with caplog.at_level(logging.DEBUG, logger="colibri.router"):
        outside = output_delta(state(matcher=Matcher([1], 3)), RequestOutput(1, token), lambda *a: None)
        errors.to_status(outside, "r1")
        for _ in range(20):
            s = state(matcher=Matcher([1], 3, outside_mask=False))
            limits = output_delta(s, RequestOutput(1, token), lambda *a: None)
            assert isinstance(limits, InvalidRequestError) and str(token) in str(limits)  # the client may see it
    lines = [r.getMessage() for r in caplog.records]
    assert lines and not [line for line in lines if str(token) in line], lines
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) <= 1


def test_a_token_whose_text_fails_fails_its_request_alone():
    """The detokenizer raising on one request's token (the tokenizer library on ids it cannot decode; before its
    fix, a RecursionError on byte-fallback garbage) reached the batching loop's catch-all, which failed every
    request in flight: one request's output could end everyone's."""
    import asyncio

    import grpc
    import pytest

    from expert_service.tools.tiny_model import byte_tokenizer
    from router_service.tokenizer import Tokenizer
    from tests.helpers import byte_ids
    from tests.router_service.fake_worker import FakeWorker, harness, wait_for

    class Poisoned(Tokenizer):
        def detokenizer(self, prompt_ids):
            detokenizer = super().detokenizer(prompt_ids)
            if list(prompt_ids)[:1] == byte_ids("!"):
                detokenizer.step = lambda token_id: [][0]  # an IndexError from deep inside
            return detokenizer

    async def body():
        fake = FakeWorker(step_delay=0.01)
        async with harness(fake, tokenizer=Poisoned(byte_tokenizer())) as (router, _, stub, _):
            params = rpb.SamplingParameters(max_new_tokens=30, ignore_eos=True)
            good = asyncio.ensure_future(stub.Generate(rpb.GenerateRequest(text="ok", parameters=params)))
            await wait_for(lambda: router.batching_loop.num_active == 1)  # in flight when the bad token comes
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(rpb.GenerateRequest(text="!bad", parameters=params))
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert (await good).generated_tokens == 30
            assert router.batching_loop.num_active == 0

    asyncio.run(body())
