"""A step stream the worker ends at shutdown (`end_streams`) while the router still sends: the steps queued ahead
of the end are answered, the steps that arrive after it never run (the stream's end frees what they would have
used), and the late masks that the last step ahead waits for still reach it. WorkerServicer.StepStream on the cpu
engine of the tiny model, with the model thread held busy so that the steps queue up behind it."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest

from common.model_format import ModelDir
from common.pb import worker_pb2 as pb
from expert_service.engine.config import EngineConfig
from expert_service.serving.lifecycle import WorkerHealth
from expert_service.serving.servicer import WorkerServicer
from tests.expert_service.engine.test_late_masks import pack
from tests.helpers import cpu_engine
from tests.router_service.fake_worker import wait_for

GREEDY = pb.SamplingParams(temperature=0, top_p=1.0)
CONSTRAINED = pb.SamplingParams(temperature=0, top_p=1.0, constrained=True)
ALLOWED = (40, 41)  # what the constrained sequence's masks allow


class Aborted(Exception):
    pass


class Context:
    """What StepStream uses of grpc.aio.ServicerContext: abort raises, as grpc's does."""

    code: grpc.StatusCode | None = None

    async def abort(self, code, details=""):
        self.code = code
        raise Aborted(details)


@pytest.fixture
def servicer(tiny_model):
    config = EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=1024, max_batch_size=8)
    engine = cpu_engine(ModelDir.open(tiny_model), config, overlap=True)
    faults: list[BaseException] = []
    servicer = WorkerServicer(WorkerHealth(watchdog_s=60.0), on_fatal=faults.append)
    servicer.attach(engine, "tiny")
    servicer.mark_ready()
    yield servicer
    servicer.executor.shutdown()
    assert not faults


def _ids(ids) -> bytes:
    return np.asarray(ids, "<u8").tobytes()


def _masks(servicer, ids) -> bytes:
    vocab = servicer.attached_engine.model_config.vocab_size
    return b"".join(pack(ALLOWED, vocab).astype("<u4").tobytes() for _ in ids)


def _launches(servicer, monkeypatch) -> list[tuple[list[int], list[int]]]:
    """(chunk ids, decode ids) of every step the engine launches: the device work the stream asks for."""
    engine, launched = servicer.attached_engine, []
    launch = engine.launch

    def recorded(chunks, decodes, *args, **kwargs):
        launched.append(([c.request_id for c in chunks], list(decodes)))
        return launch(chunks, decodes, *args, **kwargs)

    monkeypatch.setattr(engine, "launch", recorded)
    return launched


async def _end_while_sending(servicer, ahead: list[pb.StepStreamRequest], behind: list[pb.StepStreamRequest]):
    """Streams `ahead`, ends the stream while the model thread is still busy before them, then streams `behind`;
    returns the answers and the context once the stream has ended and its sequences are freed."""
    busy, go_on, handed = threading.Event(), asyncio.Event(), []
    servicer.executor.submit(busy.wait)

    async def requests():
        for request in ahead:
            handed.append(request.step_id)
            yield request
        await go_on.wait()
        for request in behind:
            handed.append(request.step_id)
            yield request

    context, answers = Context(), []

    async def consume():
        with pytest.raises(Aborted):
            async for answer in servicer.StepStream(requests(), context):
                answers.append(answer)

    consumer = asyncio.create_task(consume())
    await wait_for(lambda: len(handed) == len(ahead))
    # Not marked draining first, as the shutdown does: that would refuse the new sequences ahead, beside the point.
    servicer.end_streams()
    go_on.set()
    await wait_for(lambda: len(handed) > len(ahead))  # the receiver has read the first step behind the end
    busy.set()
    await asyncio.wait_for(consumer, 30)
    engine = servicer.attached_engine
    await wait_for(lambda: not engine.sequences and engine.allocator.num_used_blocks == 0, timeout=30)
    return answers, context


def test_steps_that_arrive_after_the_stream_ended_do_not_run(servicer, monkeypatch):
    launched = _launches(servicer, monkeypatch)
    chunk = pb.PrefillChunk(request_id=7, token_ids=[5, 6, 7, 8], sampling=GREEDY, is_last=True)
    ahead = [pb.StepStreamRequest(step_id=1, chunks=[chunk])]
    behind = [pb.StepStreamRequest(step_id=k, decode_request_ids=_ids([7])) for k in (2, 3)]
    answers, context = asyncio.run(_end_while_sending(servicer, ahead, behind))
    assert [a.step_id for a in answers] == [1] and not answers[0].errors
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert launched == [([7], [])]  # the decodes behind the end never reached the device


def test_the_late_masks_behind_the_end_still_reach_the_step_ahead(servicer, monkeypatch):
    """Step 2's constrained decode takes its mask from step 3's message, which arrives after the end: the mask is
    applied (no MISSING_TOKEN_MASK after LATE_MASKS_TIMEOUT_S) and step 3's own decode does not run."""
    launched = _launches(servicer, monkeypatch)
    chunk = pb.PrefillChunk(request_id=10, token_ids=[3, 4, 5, 6], sampling=CONSTRAINED, is_last=True)
    ahead = [
        pb.StepStreamRequest(
            step_id=1, chunks=[chunk], mask_request_ids=_ids([10]), token_masks=_masks(servicer, [10])
        ),
        pb.StepStreamRequest(step_id=2, decode_request_ids=_ids([10])),  # its mask comes late
    ]
    behind = [
        pb.StepStreamRequest(
            step_id=3,
            decode_request_ids=_ids([10]),
            late_mask_request_ids=_ids([10]),
            late_token_masks=_masks(servicer, [10]),
        )
    ]
    answers, context = asyncio.run(_end_while_sending(servicer, ahead, behind))
    assert [a.step_id for a in answers] == [1, 2] and context.code == grpc.StatusCode.UNAVAILABLE
    assert not answers[1].errors and not answers[1].step_error, (answers[1].errors, answers[1].step_error)
    assert np.frombuffer(answers[1].token_ids, "<i4").tolist()[0] in ALLOWED
    assert launched == [([10], []), ([], [10])]
