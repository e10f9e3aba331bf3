"""The worker backlog estimate (pure), and the batching loop holding the next step behind a long prefill while a
burst whose clients arrive further apart than the short quiet period is still coming in."""

from __future__ import annotations

import asyncio
import time

import pytest

from router_service import worker_backlog
from router_service.worker_backlog import BacklogConfig, WorkerBacklog
from tests.router_service.fake_worker import FakeWorker, burst_behind, harness, ids_request, wait_for


def test_pace_is_learned_from_prompt_heavy_steps_only():
    backlog = WorkerBacklog(BacklogConfig(min_prompt_tokens=100, window=3))
    assert backlog.busy_until([(1.0, 500)]) == 0.0  # nothing learned yet
    backlog.answered(sent_at=10.0, prompt_tokens=50, now=10.2)  # too small to teach
    assert backlog.seconds_per_prompt_token is None
    backlog.answered(sent_at=10.1, prompt_tokens=200, now=10.6)  # started after the answer before it (10.2)
    assert backlog.seconds_per_prompt_token == pytest.approx(0.4 / 200)
    backlog.answered(sent_at=10.7, prompt_tokens=100, now=11.3)  # idle worker: from its send
    assert backlog.seconds_per_prompt_token == pytest.approx(0.002)  # the fastest of 0.002, 0.006
    backlog.answered(sent_at=11.4, prompt_tokens=100, now=12.0, worker_seconds=0.0015)  # the worker's own time
    assert backlog.seconds_per_prompt_token == pytest.approx(1.5e-5)
    for sent in (12.1, 12.2, 12.3):  # the window (3) forgets it
        backlog.answered(sent_at=sent, prompt_tokens=100, now=sent + 0.05, worker_seconds=0.004)
    assert backlog.seconds_per_prompt_token == pytest.approx(4e-5)


def test_slow_steps_do_not_move_the_pace():
    backlog = WorkerBacklog(BacklogConfig(min_prompt_tokens=1))
    for i in range(5):
        backlog.answered(sent_at=i, prompt_tokens=1000, now=i + 0.5, worker_seconds=0.01)
    backlog.answered(sent_at=9, prompt_tokens=1000, now=20, worker_seconds=10.0)  # a first launch capturing graphs
    assert backlog.seconds_per_prompt_token == pytest.approx(1e-5)
    backlog.answered(sent_at=21, prompt_tokens=1000, now=22, worker_seconds=0.015)  # a chunk over a long prefix
    assert backlog.seconds_per_prompt_token == pytest.approx(1e-5)  # plain chunks set the pace
    for i in range(backlog.config.window):  # the window (of their size class) forgets them
        backlog.answered(sent_at=30 + i, prompt_tokens=1000, now=30.5 + i, worker_seconds=0.02)
    assert backlog.seconds_per_prompt_token == pytest.approx(2e-5)


def test_a_step_is_estimated_at_the_pace_of_steps_of_its_size():
    """Fixed costs weigh more on small steps: a 300-token step is estimated at the pace of the steps of its size
    class (256-511 tokens), not of the long chunks, which are faster a token, however many chunks ran since; a
    class not seen takes the nearest larger class's pace, or with none larger the nearest smaller one's."""
    backlog = WorkerBacklog(BacklogConfig(min_prompt_tokens=256, window=3))
    backlog.answered(sent_at=1.0, prompt_tokens=300, now=2.0, worker_seconds=0.009)  # 30 us a token
    backlog.answered(sent_at=2.0, prompt_tokens=280, now=3.0, worker_seconds=0.0112)  # 40 us a token
    for i in range(5):  # more long chunks than the window holds
        backlog.answered(sent_at=4.0 + i, prompt_tokens=2000, now=4.5 + i, worker_seconds=0.020)  # 10 us a token
    assert backlog.seconds_per_prompt_token == pytest.approx(1e-5)
    assert backlog.pace(300) == pytest.approx(3e-5)  # the fastest of the 300 and 280-token steps
    assert backlog.pace(1500) == pytest.approx(1e-5)  # 1,024-2,047
    assert backlog.pace(700) == pytest.approx(1e-5)  # 512-1,023 not seen: the 1,024-2,047 class
    assert backlog.pace(40_000) == pytest.approx(1e-5)  # the 1,024-2,047 class
    assert backlog.pace(100) == pytest.approx(3e-5)  # the 256-511 class
    until = backlog.busy_until([(9.5, 2000), (9.6, 300), (9.7, 0)])  # chunk, small step, decodes
    assert until == pytest.approx(9.5 + 0.020 + 0.009)


def test_the_wait_stretches_only_behind_a_long_prefill():
    backlog = WorkerBacklog(BacklogConfig(min_prompt_tokens=1))
    assert backlog.arrival_wait([(0.0, 4000)], 0.005, 0.001) == (0.005, 0.001)  # nothing learned: as given
    backlog.answered(sent_at=0.0, prompt_tokens=1000, now=1.0, worker_seconds=0.01)  # 10 us a token
    until, quiet = backlog.arrival_wait([(2.0, 2000)], 2.005, 0.001)
    assert until == pytest.approx(2.0 + 0.02 - worker_backlog.SEND_MARGIN_S)
    assert quiet == worker_backlog.ARRIVAL_QUIET_LONG_S
    assert backlog.arrival_wait([(2.0, 500)], 2.005, 0.001) == (2.005, 0.001)  # 5 ms of work: no longer than usual


def test_busy_until_starts_from_the_later_of_send_and_last_answer():
    backlog = WorkerBacklog(BacklogConfig(min_prompt_tokens=1))
    backlog.answered(sent_at=0.0, prompt_tokens=1000, now=1.0)  # 1 ms a token
    assert backlog.busy_until([]) == 0.0
    assert backlog.busy_until([(0.5, 100)]) == pytest.approx(1.1)  # queued behind the answered step
    assert backlog.busy_until([(2.0, 100), (2.01, 300)]) == pytest.approx(2.4)  # decodes (0 prompt) add nothing
    assert backlog.busy_until([(2.0, 0)]) == pytest.approx(2.0)


@pytest.mark.parametrize("learned", [True, False])
def test_a_spread_burst_joins_the_step_behind_a_long_prefill(monkeypatch, learned):
    """Clients 30 ms apart (far past the short quiet period) arrive while a 320-token prefill runs for 0.5 s. With
    the pace learned from an earlier long prefill, the loop holds the next step until the burst pauses for the
    long quiet period, and all five join it; without a pace it schedules at once, as before."""
    from router_service import step_pipeline

    monkeypatch.setattr(step_pipeline, "ARRIVAL_QUIET_S", 0.001)
    monkeypatch.setattr(step_pipeline, "ARRIVAL_WINDOW_S", 0.005)
    monkeypatch.setattr(worker_backlog, "ARRIVAL_QUIET_LONG_S", 0.1)
    monkeypatch.setattr(worker_backlog, "SEND_MARGIN_S", 0.05)

    async def main():
        fake = FakeWorker(step_delay=0.5, max_batch_tokens=512)
        async with harness(fake, pipeline_depth=2) as (router, _, stub, _):
            loop = router.batching_loop
            if learned:  # one 320-token prompt, one step of 0.5 s as the fake worker reports it: ~1.6 ms a token
                await stub.Generate(ids_request([3 + i % 250 for i in range(320)], max_new_tokens=1))
                assert loop._pipeline._backlog.seconds_per_prompt_token is not None
                await wait_for(lambda: not loop._pipeline)  # the step carrying its free has run too
            return await burst_behind(stub, loop, [5 + i % 250 for i in range(320)], gap_s=0.03)

    new_per_step = asyncio.run(main())
    assert new_per_step[:2] == ([1, 5] if learned else [1, 0])


class DeviceTimelineWorker(FakeWorker):
    """A fake worker whose device runs steps back to back (a step starts once it has arrived and the one before
    ended, as the worker's launch-ahead does) and whose answer leaves `answer_delay` after the device work (collect,
    response, transit): `device` records (arrived, start, end) per step."""

    def __init__(self, answer_delay: float, **kwargs):
        super().__init__(**kwargs)
        self.answer_delay = answer_delay
        self.device: list[tuple[float, float, float]] = []

    async def StepStream(self, request_iterator, context):
        answers: asyncio.Queue = asyncio.Queue()

        async def receive():
            async for request in request_iterator:
                arrived = time.monotonic()
                start = max(arrived, self.device[-1][2] if self.device else 0.0)
                self.device.append((arrived, start, start + self.step_delay))
                answers.put_nowait((request, start + self.step_delay + self.answer_delay))
            answers.put_nowait(None)

        receiver = asyncio.create_task(receive())
        try:
            while (item := await answers.get()) is not None:
                request, due = item
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                yield self.answer(request)
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)


def test_the_hold_does_not_idle_the_device_when_nothing_arrives():
    """One long prompt in 12 chunks of 30 ms at pipeline depth 2, nothing else arriving, answers 5 ms after the
    device work: the estimate of the running chunk's end starts from the router's receipt of the answer before,
    later than the worker started it, so a hold lasting until that estimate would leave the device idle ~4 ms a
    chunk (measured with no pause ending it: 29 ms over the prompt). With the pause ending it, none."""

    async def main():
        fake = DeviceTimelineWorker(0.005, step_delay=0.03, max_batch_tokens=512, num_blocks=4096)
        fake.max_position_embeddings = 8192
        async with harness(fake, pipeline_depth=2) as (router, _, stub, _):
            loop = router.batching_loop
            await stub.Generate(ids_request([3 + i % 250 for i in range(600)], max_new_tokens=1))  # learn a pace
            await wait_for(lambda: not loop._pipeline)
            fake.device.clear()
            await stub.Generate(ids_request([5 + i % 250 for i in range(512 * 12)], max_new_tokens=1))
            return list(fake.device)

    device = asyncio.run(main())
    assert len(device) >= 12
    chunks = device[:12]  # the prompt's chunks (its decode and free follow)
    idle = [max(0.0, later[1] - earlier[2]) for earlier, later in zip(chunks, chunks[1:])]
    # the defect idles every other gap 3-7 ms (5 or 6 of the 11: the answer to each chunk arrives behind the next
    # one); a loaded machine can stall the event loop in a few gaps (8 ms in all once in CI, 16 ms in one gap
    # another time, three gaps once), so the three longest gaps are tolerated whatever their length and the rest
    # must stay short
    gaps_ms = [round(s * 1e3, 1) for s in idle]
    assert sum(s > 0.002 for s in idle) <= 3 and sum(sorted(idle)[:-3]) < 0.006, gaps_ms
