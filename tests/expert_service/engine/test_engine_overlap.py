"""Steps launched before the step ahead of them is collected (Engine.launch / collect, StepPump): the tokens are
the ones sequential steps give, decodes take their input from the step in flight, and a sequence freed while its
step runs comes back as UNKNOWN_SEQUENCE without disturbing the others. On the cpu engine of the tiny model, and
(gpu) on the cuda backend, where the input tokens are read from the device's argmax."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import Backend, EngineConfig
from expert_service.engine.engine import UNKNOWN_SEQUENCE, PrefillInput
from expert_service.engine.penalties import PenaltyParams
from expert_service.engine.sampling import SamplingParams
from expert_service.serving.lifecycle import ModelThread
from expert_service.serving.step_stream import StepPump, StepRequest, StreamSession
from expert_service.tools.tiny_model import make_tiny
from tests.helpers import cpu_engine

GREEDY = SamplingParams()
EMPTY = np.zeros(0, "<u8")


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 200, n)


def _plan():
    """(frees, prefill chunks, decode ids) per step: sequences join mid-run (one prompt in two chunks), one is
    freed while a step holding it may still be in flight, decodes follow their sequence's first token."""
    a, b, c = _prompt(1, 7), _prompt(2, 12), _prompt(3, 9)
    steps = [
        ((), [PrefillInput(1, a, GREEDY, True), PrefillInput(2, b, GREEDY, True)], ()),
        ((), [], (1, 2)),
        ((), [PrefillInput(3, c[:5], GREEDY, False)], (1, 2)),
        ((), [PrefillInput(3, c[5:], GREEDY, True)], (1, 2)),
        ((), [], (1, 2, 3)),
        ((2,), [], (1, 3)),
    ]
    return steps + [((), [], (1, 3))] * 6


def _outputs(result):
    return [(o.request_id, o.token_id, o.error) for o in result.outputs]


def _sequential(engine, plan):
    out = []
    for frees, chunks, decodes in plan:
        engine.release(frees)
        out.append(_outputs(engine.step(chunks, list(decodes))))
    return out


def _overlapped(engine, plan, depths: list[int]):
    """Each step launched before the one ahead is collected whenever the engine allows it."""
    out, ahead = [], None
    for frees, chunks, decodes in plan:
        if ahead is not None and not engine.can_launch:
            out.append(_outputs(engine.collect(ahead)))
            ahead = None
        engine.release(frees)
        depths.append(len(engine._in_flight))
        step = engine.launch(chunks, list(decodes))
        if ahead is not None:
            out.append(_outputs(engine.collect(ahead)))
        ahead = step
    out.append(_outputs(engine.collect(ahead)))
    return out


def _engines(request, tmp_path_factory):
    backend, family, *cache = request.param
    if backend == "cuda":
        model = make_tiny(tmp_path_factory.mktemp(family) / "m", family=family, seed=5)
    else:
        model = request.getfixturevalue("tiny_model")
    # "cache": the expert cache at one slot a layer with the device lookahead, whose slot map and prefetches a
    # step launched behind another must see in stream order (in every step: by default one slot holds no step's
    # top-k, so none would prefetch)
    cached = dict(expert_cache_slots=1, prefetch="lookahead", prefetch_large_steps=True) if cache else {}
    config = EngineConfig(
        backend=backend, kv_block_size=4, kv_cache_tokens=1024, max_batch_tokens=128, max_batch_size=8, **cached
    )
    # the cpu decoder overlaps only when built to (its launch runs the step at once): here, to run the logic
    first = cpu_engine(ModelDir.open(model), config, overlap=True) if backend == "cpu" else None
    return first or build_engine(ModelDir.open(model), config), build_engine(ModelDir.open(model), config)


class Gate:
    """Holds the model thread (a job waiting on an event) until `open`, so that steps submitted meanwhile are all
    queued when the pump starts: which step is in flight when another launches is then deterministic."""

    def __init__(self, thread):
        self.event = threading.Event()
        thread.submit(self.event.wait)

    def open(self):
        self.event.set()


def _recording_launches(engine, monkeypatch) -> list[int]:
    """Steps in flight when each launch starts."""
    depths, launch = [], engine.launch

    def recording_launch(*args, **kwargs):
        depths.append(len(engine._in_flight))
        return launch(*args, **kwargs)

    monkeypatch.setattr(engine, "launch", recording_launch)
    return depths


@pytest.fixture(
    scope="module",
    params=[
        ("cpu", "tiny"),
        pytest.param(("cuda", "mixtral"), marks=pytest.mark.gpu),
        pytest.param(("cuda", "qwen3_moe"), marks=pytest.mark.gpu),
        pytest.param(("cuda", "mixtral", "cache"), marks=pytest.mark.gpu),
    ],
    ids=lambda p: "-".join(p),
)
def engines(request, tmp_path_factory):
    first, second = _engines(request, tmp_path_factory)
    yield first, second
    first.close()
    second.close()


def test_overlapped_steps_give_the_sequential_tokens(engines):
    overlapped, sequential = engines
    depths = []
    got, want = _overlapped(overlapped, _plan(), depths), _sequential(sequential, _plan())
    assert max(depths) == 1, "no step was launched while another was in flight"
    assert len(got) == len(want)
    for index, (g, w) in enumerate(zip(got, want)):
        if index == 4:  # sequence 2 was freed (at step 5's launch) while step 4 ran: its output is dropped
            assert dict((r, e) for r, _, e in g)[2] == UNKNOWN_SEQUENCE
            g, w = [o for o in g if o[0] != 2], [o for o in w if o[0] != 2]
        assert g == w, f"step {index}"
    for engine in engines:
        engine.clear()
        assert engine.allocator.num_used_blocks == 0 and not engine._in_flight


def test_steps_that_need_their_rows_on_the_host_are_collected_first(engines):
    """A sampled (temperature) row, logprobs or a penalty: the step's rows must reach the host before the next
    step overwrites them, so nothing launches behind it; collection keeps launch order."""
    engine = engines[0]
    for sampling in (
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(logprobs=True),
        SamplingParams(penalties=PenaltyParams(repetition=1.3)),
    ):
        step = engine.launch([PrefillInput(7, _prompt(7, 5), sampling, True)])
        assert not engine.can_launch
        with pytest.raises(RuntimeError, match="in flight"):
            engine.launch(decode_ids=[7])
        assert engine.collect(step).outputs[0].token_id is not None
        engine.clear()
    first = engine.launch([PrefillInput(8, _prompt(8, 5), GREEDY, True)])
    second = engine.launch(decode_ids=[8])
    assert not engine.can_launch  # two in flight: the first must be collected
    with pytest.raises(RuntimeError, match="order"):
        engine.collect(second)
    assert [o.error for o in engine.collect(first).outputs + engine.collect(second).outputs] == ["", ""]
    engine.clear()


def test_the_pump_overlaps_a_streams_steps_and_answers_in_order(engines, monkeypatch):
    """Steps submitted ahead (as a pipelining router sends them) run back to back on the model thread, each
    launched before the one ahead of it is collected; the outcomes are the sequential run's."""
    engine, reference = engines
    prompts = {10 + i: _prompt(20 + i, 3 + 4 * i) for i in range(3)}
    first = [PrefillInput(r, p, GREEDY, True) for r, p in prompts.items()]
    want = [_outputs(reference.step(first))] + [_outputs(reference.step(decode_ids=list(prompts))) for _ in range(8)]
    reference.clear()
    depths = _recording_launches(engine, monkeypatch)
    thread = ModelThread("test-model")
    try:
        pump = StepPump(StreamSession(engine, {}), thread)
        gate = Gate(thread)
        ids = np.fromiter(prompts, "<u8")
        futures = [pump.submit(StepRequest(1, EMPTY, first, EMPTY, None))]
        futures += [pump.submit(StepRequest(2 + i, EMPTY, [], ids, None)) for i in range(8)]
        gate.open()
        outcomes = [f.result(timeout=120) for f in futures]
    finally:
        thread.shutdown()
    assert [o.step_id for o in outcomes] == list(range(1, 10))
    assert [_outputs(o.result) for o in outcomes] == want
    assert depths == [0] + [1] * 8, "each step after the first launched behind the one before"
    engine.clear()


def test_the_pump_steps_aside_for_other_model_thread_work(engines):
    """A stream that keeps the model thread busy still lets other jobs (heartbeats, unary calls, other streams)
    run between its steps, with nothing of it in flight while they do."""
    engine = engines[0]
    thread = ModelThread("test-model")
    try:
        pump = StepPump(StreamSession(engine, {}), thread)
        gate = Gate(thread)
        futures = [pump.submit(StepRequest(1, EMPTY, [PrefillInput(50, _prompt(50, 4), GREEDY, True)], EMPTY, None))]
        futures += [pump.submit(StepRequest(2 + i, EMPTY, [], np.array([50], "<u8"), None)) for i in range(6)]
        seen = []
        other = thread.submit(lambda: seen.append((sum(f.done() for f in futures), len(engine._in_flight))))
        gate.open()
        other.result(timeout=60)
        assert [f.result(timeout=60).step_id for f in futures] == list(range(1, 8))
    finally:
        thread.shutdown()
    done_before, in_flight = seen[0]
    assert done_before < len(futures) and in_flight == 0
    engine.clear()


def test_close_runs_after_the_streams_queued_steps(engines):
    """The stream's close goes through its pump: steps queued before it run first, then everything the stream
    started is freed (nothing is left holding KV blocks)."""
    engine = engines[0]
    thread = ModelThread("test-model")
    try:
        pump = StepPump(StreamSession(engine, {}), thread)
        gate = Gate(thread)
        futures = [
            pump.submit(
                StepRequest(
                    1, EMPTY, [PrefillInput(60 + i, _prompt(60 + i, 5), GREEDY, True) for i in range(2)], EMPTY, None
                )
            ),
            pump.submit(StepRequest(2, EMPTY, [], np.array([60, 61], "<u8"), None)),
            pump.submit(
                StepRequest(3, EMPTY, [PrefillInput(62, _prompt(62, 3), GREEDY, True)], np.array([60, 61], "<u8"), None)
            ),
        ]
        closed = pump.close()
        gate.open()
        closed.result(timeout=60)
        assert all(f.done() for f in futures)
    finally:
        thread.shutdown()
    assert not engine.sequences and engine.allocator.num_used_blocks == 0 and not engine._in_flight


def test_a_fault_reaches_every_waiting_step_and_the_fatal_path(engines, monkeypatch):
    """A fault while steps are in flight: every waiting step of the stream gets it, `on_fault` (the worker's
    fatal path) gets it even when nobody awaits, and the engine is left with nothing in flight."""
    engine = engines[0]
    thread = ModelThread("test-model")
    faults = []
    try:
        pump = StepPump(StreamSession(engine, {}), thread, on_fault=faults.append)
        prompt = StepRequest(1, EMPTY, [PrefillInput(30, _prompt(30, 4), GREEDY, True)], EMPTY, None)
        decode = StepRequest(2, EMPTY, [], np.array([30], "<u8"), None)
        assert pump.submit(prompt).result(timeout=60).result.outputs[0].token_id is not None

        def broken(step):
            raise RuntimeError("device lost")

        monkeypatch.setattr(engine, "collect", broken)
        gate = Gate(thread)
        futures = [pump.submit(decode) for _ in range(3)]
        gate.open()
        for future in futures:
            with pytest.raises(RuntimeError, match="device lost"):
                future.result(timeout=60)
        monkeypatch.undo()
        assert [str(f) for f in faults] == ["device lost"] and not engine._in_flight
        assert engine.can_launch
        # the steps the fault abandoned are forgotten by the decoder too: the engine steps on
        assert engine.step(decode_ids=[30]).outputs[0].request_id == 30
    finally:
        thread.shutdown()
        engine.clear()


def _pump_run(engine, steps, monkeypatch):
    """The steps through a StepPump, all queued before it starts: (outputs or step_error per step, launch depths)."""
    depths = _recording_launches(engine, monkeypatch)
    thread = ModelThread("test-model")
    try:
        pump = StepPump(StreamSession(engine, {}), thread)
        gate = Gate(thread)
        futures = [pump.submit(s) for s in steps]
        gate.open()
        outcomes = [f.result(timeout=60) for f in futures]
    finally:
        thread.shutdown()
    monkeypatch.undo()
    return [_outputs(o.result) if o.result is not None else o.refused for o in outcomes], depths


def _session_run(engine, steps):
    session = StreamSession(engine, {})
    outcomes = [session.run(s) for s in steps]
    return [_outputs(o.result) if o.result is not None else o.refused for o in outcomes]


def test_a_free_of_a_sequence_in_flight_waits_for_that_steps_collection(engines, monkeypatch):
    """The router frees a sequence in step t+1 while step t, which holds it, may still run: step t still samples
    it (the free takes effect after t is collected), and t+1's decode of it is UNKNOWN_SEQUENCE -- what
    sequential steps give."""
    engine = engines[0]
    steps = [
        StepRequest(
            1,
            EMPTY,
            [PrefillInput(40, _prompt(40, 5), GREEDY, True), PrefillInput(41, _prompt(41, 6), GREEDY, True)],
            EMPTY,
            None,
        ),
        StepRequest(2, EMPTY, [], np.array([40, 41], "<u8"), None),
        StepRequest(3, np.array([41], "<u8"), [], np.array([40, 41], "<u8"), None),
        StepRequest(4, EMPTY, [], np.array([40], "<u8"), None),
    ]
    want = _session_run(engine, steps)
    engine.clear()
    got, depths = _pump_run(engine, steps, monkeypatch)
    assert depths == [0, 1, 1, 1], "step 3 was not launched while step 2 ran"
    assert got == want
    assert dict((r, e) for r, _, e in got[2])[41] == UNKNOWN_SEQUENCE and all(not e for _, _, e in got[1])
    engine.clear()
    assert engine.allocator.num_used_blocks == 0


def test_a_frees_only_step_behind_one_in_flight_frees_before_the_next_step(engines, monkeypatch):
    """Step 3 only frees a sequence step 2 still holds: the free takes effect before step 4, which reuses its id
    for a new prompt and needs its KV blocks (a pool of 8 blocks), as with sequential steps."""
    config = replace(engines[0].config, kv_cache_tokens=32)
    if engines[0].backend is Backend.CPU:
        engine = cpu_engine(engines[0].model, config, overlap=True)
    else:
        engine = build_engine(engines[0].model, config)
    steps = [
        StepRequest(1, EMPTY, [PrefillInput(70, _prompt(70, 20), GREEDY, True)], EMPTY, None),
        StepRequest(2, EMPTY, [], np.array([70], "<u8"), None),
        StepRequest(3, np.array([70], "<u8"), [], EMPTY, None),
        StepRequest(4, EMPTY, [PrefillInput(70, _prompt(71, 24), GREEDY, True)], EMPTY, None),
        StepRequest(5, EMPTY, [], np.array([70], "<u8"), None),
    ]
    want = _session_run(engine, steps)
    engine.clear()
    got, _ = _pump_run(engine, steps, monkeypatch)
    assert got == want and got[2] == ""  # frees only: no result, not refused
    assert all(not e for g in got[:2] + got[3:] for _, _, e in g)
    engine.clear()
    assert engine.allocator.num_used_blocks == 0
    engine.close()


def test_a_refused_step_behind_one_in_flight_leaves_it_intact(engines, monkeypatch):
    """A step refused as a whole (an out-of-vocabulary token) while another is in flight: the one in flight is
    answered, the refusal is that step's alone, and the next steps go on as with sequential steps."""
    engine = engines[0]
    vocab = engine.model_config.vocab_size
    steps = [
        StepRequest(1, EMPTY, [PrefillInput(80, _prompt(80, 5), GREEDY, True)], EMPTY, None),
        StepRequest(2, EMPTY, [], np.array([80], "<u8"), None),
        StepRequest(3, EMPTY, [PrefillInput(81, np.array([vocab]), GREEDY, True)], np.array([80], "<u8"), None),
        StepRequest(4, EMPTY, [], np.array([80], "<u8"), None),
    ]
    want = _session_run(engine, steps)
    engine.clear()
    got, _ = _pump_run(engine, steps, monkeypatch)
    assert got == want and "token_ids" in got[2]
    engine.clear()


def test_the_host_backend_does_not_overlap_in_production(tiny_model):
    """The cpu decoder runs a step at launch: a step launched behind another would only delay the other's
    answer, so its engine collects before it launches the next."""
    engine = build_engine(ModelDir.open(tiny_model), EngineConfig(backend="cpu", kv_block_size=4, kv_cache_tokens=256))
    step = engine.launch([PrefillInput(90, _prompt(90, 4), GREEDY, True)])
    assert not engine.can_launch
    engine.collect(step)
    engine.close()
