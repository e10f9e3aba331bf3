"""Frontend.submit when the worker reconnects while a request is being tokenized: a restart may bring a smaller KV
pool (or another vocabulary), and the request is judged by the limits of the worker it is submitted to."""

import asyncio

import pytest

from common.errors import InvalidRequestError
from common.pb import router_pb2
from router_service import errors
from router_service.batching_loop import BatchingLoop
from router_service.config import RouterConfig
from router_service.frontend import Frontend
from router_service.scheduler import Scheduler, SchedulerLimits
from router_service.validation import ModelLimits, ValidatedRequest, validate_request

CONFIG = RouterConfig(max_new_tokens=100, default_max_new_tokens=50)
BLOCK = 4


class PausingTokenizer:
    """Ten ids per text; encode_async waits until the test lets it finish (the worker reconnects meanwhile)."""

    def __init__(self):
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    def encode(self, text, add_special_tokens=True):
        return list(range(1, 11))

    async def encode_async(self, text, add_special_tokens=True):
        self.entered.set()
        await self.release.wait()
        return self.encode(text)

    def detokenizer(self, prompt_ids):
        return None


def _connect(loop: BatchingLoop, num_blocks: int, vocab_size: int = 100) -> ModelLimits:
    """What BatchingLoop._configure does on a (re)connect: new limits and a new scheduler."""
    loop.limits = ModelLimits(
        vocab_size=vocab_size,
        max_sequence_length=4096,
        kv_capacity_tokens=BLOCK * num_blocks,
        eos_token_ids=(0,),
        has_tokenizer=True,
    )
    loop.scheduler = Scheduler(SchedulerLimits(8, 64, BLOCK, num_blocks))
    loop.is_worker_ready = True
    return loop.limits


def _text(**params) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(text="hello", parameters=router_pb2.SamplingParameters(**params))


async def _submit_across_restart(request, num_blocks_after: int, vocab_after: int = 100):
    tokenizer = PausingTokenizer()
    loop = BatchingLoop(CONFIG, None, tokenizer=tokenizer)
    _connect(loop, num_blocks=16)  # 64 tokens of KV
    frontend = Frontend(loop)
    submitting = asyncio.create_task(frontend.submit(request, None, stream=False))
    await tokenizer.entered.wait()
    after = _connect(loop, num_blocks=num_blocks_after, vocab_size=vocab_after)  # the worker restarted
    tokenizer.release.set()
    try:
        return loop, after, await submitting
    finally:
        assert frontend._num_admitting == 0


@pytest.mark.parametrize(
    "params, vocab_after",
    [({"max_new_tokens": 40}, 100), ({"max_new_tokens": 5}, 8)],
    ids=["kv pool shrank", "vocabulary shrank"],
)
def test_a_request_validated_before_a_worker_restart_is_refused_as_a_fresh_one_would_be(params, vocab_after):
    """10 prompt + 40 new tokens fit the first worker's 64-token pool, not the restarted one's 32: Scheduler.add
    raised a bare ValueError ("needs more KV blocks than exist"), an INTERNAL answer with a traceback in the log.
    Now the request gets the INVALID_ARGUMENT a request validated against the new worker gets, word for word."""
    request = _text(**params)

    async def main():
        with pytest.raises(InvalidRequestError) as refused:
            await _submit_across_restart(request, num_blocks_after=8, vocab_after=vocab_after)
        return refused.value

    refused = asyncio.run(main())
    after = ModelLimits(
        vocab_size=vocab_after, max_sequence_length=4096, kv_capacity_tokens=32, eos_token_ids=(0,), has_tokenizer=True
    )
    with pytest.raises(InvalidRequestError) as fresh:
        validate_request(request, CONFIG, after, PausingTokenizer())
    assert str(refused) == str(fresh.value)
    assert errors.to_status(refused).code.name == "INVALID_ARGUMENT"


def test_a_default_length_is_fitted_to_the_restarted_workers_pool():
    """Left unset, max_new_tokens is shortened to fit (as for any request), not refused."""

    async def main():
        loop, _, handle = await _submit_across_restart(_text(), num_blocks_after=8)
        return [r.max_new_tokens for r in loop.scheduler.requests.values()]

    assert asyncio.run(main()) == [32 - 10]


def test_the_batching_loop_refuses_a_request_too_large_for_its_pool_without_holding_it():
    """BatchingLoop.submit itself answers INVALID_ARGUMENT (not a ValueError) for a request its scheduler's pool
    cannot hold, and keeps nothing of it."""
    loop = BatchingLoop(CONFIG, None)
    _connect(loop, num_blocks=8)
    req = ValidatedRequest("", tuple(range(1, 11)), 40, 0, 0.0, 0, 1.0, 7, (), (), False, False)
    with pytest.raises(InvalidRequestError, match=r"^parameters.max_new_tokens: .*KV capacity \(32\)"):
        loop.submit(req)
    assert loop.num_active == 0 and not loop.scheduler.requests
