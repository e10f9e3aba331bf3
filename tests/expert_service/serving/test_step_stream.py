"""StreamSession on the cpu engine of the tiny model: which sequences a session owns, and that everything a
sequence holds (its KV blocks, its penalty state slot) comes back when it is freed or its stream ends."""

from __future__ import annotations

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import UNKNOWN_SEQUENCE, PrefillInput
from expert_service.engine.penalties import PenaltyParams
from expert_service.engine.sampling import SamplingParams
from expert_service.serving.step_stream import FOREIGN_SEQUENCE, StepRequest, StreamSession

PENALISED = SamplingParams(penalties=PenaltyParams(repetition=1.3, frequency=0.5))


@pytest.fixture(scope="module")
def engine(tiny_model):
    return build_engine(
        ModelDir.open(tiny_model), EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=512, max_batch_size=4)
    )


@pytest.fixture
def owners(engine):
    owners: dict[int, int] = {}
    yield owners
    engine.clear()


def _step(session, chunks=(), decodes=(), frees=()):
    return session.run(StepRequest(0, np.asarray(frees, "<u8"), list(chunks), np.asarray(decodes, "<u8"), None))


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 200, n)


def _holds_nothing(engine) -> bool:
    return not engine.sequences and not engine.penalty_slots.slots and engine.allocator.num_used_blocks == 0


def test_a_decode_sent_mid_prefill_fails_alone_and_the_sequence_stays_the_sessions_to_free(engine, owners):
    """The decode fails with UNKNOWN_SEQUENCE, but the engine still holds the half-prefilled sequence: the
    session keeps owning it, so the router's free (or the stream's end) returns its blocks and penalty slot, and
    no other stream may step it."""
    session, other = StreamSession(engine, owners), StreamSession(engine, owners)
    _step(session, [PrefillInput(7, _prompt(1, 5), PENALISED, False)])
    assert _step(session, decodes=[7]).result.outputs[0].error == UNKNOWN_SEQUENCE
    assert _step(other, [PrefillInput(7, _prompt(2, 2), None, True)]).result.outputs[0].error == FOREIGN_SEQUENCE
    _step(session, frees=[7])
    assert _holds_nothing(engine), (list(engine.sequences), engine.penalty_slots.slots)

    _step(session, [PrefillInput(8, _prompt(3, 5), PENALISED, False)])
    _step(session, decodes=[8])
    session.close()
    assert _holds_nothing(engine), (list(engine.sequences), engine.penalty_slots.slots)


def test_a_pool_past_65536_blocks_takes_the_evictions_and_prefixes_a_router_sends(tiny_model):
    """A pool of more than 65,536 KV blocks (a large --kv-cache-tokens, or a small --kv-block-size): the router
    starts a sequence on every cached block of its prompt, and one admission evicts every cached block it needs the
    room of, each past 65,536 ids in one step. Refused as malformed, such a step ran neither its frees nor its
    evictions: the worker kept blocks the router counted free, and the steps using that room were refused too. Ids
    past the pool's blocks are still refused."""
    from common.errors import InvalidRequestError
    from common.pb import worker_pb2 as pb
    from expert_service.serving import wire as worker_wire
    from expert_service.serving.step_stream import MAX_FREE_IDS, StepLimits
    from router_service import wire
    from router_service.prefix_cache import PrefixCache
    from router_service.scheduler import RequestOutput, ScheduledRequest, Scheduler, SchedulerLimits

    blocks = MAX_FREE_IDS + 4_000
    config = EngineConfig(
        backend="cpu", kv_block_size=1, num_kv_blocks=blocks, max_batch_tokens=blocks, max_batch_size=4
    )
    limits = StepLimits.of(build_engine(ModelDir.open(tiny_model), config))
    scheduler = Scheduler(SchedulerLimits(4, blocks, 1, blocks), PrefixCache(1, b"model"))
    n = blocks - 1_000
    prompt, other = [3 + i % 200 for i in range(n)], [4 + i % 200 for i in range(n)]

    def sent(request_id: int, prompt: list[int]):
        scheduler.add(ScheduledRequest(request_id, prompt, 1, sampling=pb.SamplingParams()))
        step = scheduler.schedule()
        message = pb.StepStreamRequest.FromString(wire.step_request(step, request_id).SerializeToString())
        back = worker_wire.step_request(message, limits)  # refused: InvalidRequestError
        scheduler.update(step, [RequestOutput(request_id, 9)])  # one token: finished, its blocks stay cached
        return step, back

    sent(1, prompt)
    step, back = sent(2, prompt + [7])  # starts on the n blocks request 1 cached
    assert len(back.chunks[0].prefix_block_ids) == n > MAX_FREE_IDS
    step, back = sent(3, other)  # its room is the cached blocks: evicted in its step
    assert len(back.evict_ids) == len(step.evict_block_ids) > MAX_FREE_IDS and back.free_ids.tolist() == [2]
    with pytest.raises(InvalidRequestError, match="evict_block_ids"):
        worker_wire.step_request(pb.StepStreamRequest(step_id=4, evict_block_ids=bytes(8 * (blocks + 1))), limits)
