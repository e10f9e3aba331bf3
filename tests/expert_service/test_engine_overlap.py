"""Steps launched before the step ahead of them is collected (Engine.launch / collect, StepPump): the tokens are
the ones sequential steps give, decodes take their input from the step in flight, and a sequence freed while its
step runs comes back as UNKNOWN_SEQUENCE without disturbing the others. On the cpu engine of the tiny model, and
(gpu) on the cuda backend, where the input tokens are read from the device's argmax."""
from __future__ import annotations

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.config import EngineConfig
from expert_service.engine import UNKNOWN_SEQUENCE, Engine, PrefillInput
from expert_service.lifecycle import ModelThread
from expert_service.penalties import PenaltyParams
from expert_service.sampling import SamplingParams
from expert_service.step_stream import StepPump, StreamSession, StreamStep
from expert_service.tiny_model import make_tiny

GREEDY = SamplingParams()


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 200, n)


def _plan():
    """(frees, prefill chunks, decode ids) per step: sequences join mid-run (one prompt in two chunks), one is
    freed while a step holding it may still be in flight, decodes follow their sequence's first token."""
    a, b, c = _prompt(1, 7), _prompt(2, 12), _prompt(3, 9)
    steps = [((), [PrefillInput(1, a, GREEDY, True), PrefillInput(2, b, GREEDY, True)], ()),
             ((), [], (1, 2)),
             ((), [PrefillInput(3, c[:5], GREEDY, False)], (1, 2)),
             ((), [PrefillInput(3, c[5:], GREEDY, True)], (1, 2)),
             ((), [], (1, 2, 3)),
             ((2,), [], (1, 3))]
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
    backend, family = request.param
    if backend == "cuda":
        model = make_tiny(tmp_path_factory.mktemp(family) / "m", family=family, seed=5)
    else:
        model = request.getfixturevalue("tiny_model")
    config = EngineConfig(backend=backend, kv_block_size=4, kv_cache_tokens=1024, max_batch_tokens=128,
                          max_batch_size=8)
    return Engine(ModelDir.open(model), config), Engine(ModelDir.open(model), config)


@pytest.fixture(scope="module", params=[("cpu", "tiny"),
                                        pytest.param(("cuda", "mixtral"), marks=pytest.mark.gpu),
                                        pytest.param(("cuda", "qwen3_moe"), marks=pytest.mark.gpu)],
                ids=lambda p: "-".join(p))
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
        if index == 4:       # sequence 2 was freed (at step 5's launch) while step 4 ran: its output is dropped
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
    for sampling in (SamplingParams(temperature=0.8, seed=1), SamplingParams(logprobs=True),
                     SamplingParams(penalties=PenaltyParams(repetition=1.3))):
        step = engine.launch([PrefillInput(7, _prompt(7, 5), sampling, True)])
        assert not engine.can_launch
        with pytest.raises(RuntimeError, match="in flight"):
            engine.launch(decode_ids=[7])
        assert engine.collect(step).outputs[0].token_id is not None
        engine.clear()
    first = engine.launch([PrefillInput(8, _prompt(8, 5), GREEDY, True)])
    second = engine.launch(decode_ids=[8])
    assert not engine.can_launch        # two in flight: the first must be collected
    with pytest.raises(RuntimeError, match="order"):
        engine.collect(second)
    assert [o.error for o in engine.collect(first).outputs + engine.collect(second).outputs] == ["", ""]
    engine.clear()


def test_the_pump_overlaps_a_streams_steps_and_answers_in_order(engines):
    """Steps submitted ahead (as a pipelining router sends them) run back to back on the model thread, each
    launched before the one ahead of it is collected; the outcomes are the sequential run's."""
    engine, reference = engines
    prompts = {10 + i: _prompt(20 + i, 3 + 4 * i) for i in range(3)}
    first = [PrefillInput(r, p, GREEDY, True) for r, p in prompts.items()]
    want = [_outputs(reference.step(first))] + [_outputs(reference.step(decode_ids=list(prompts)))
                                                for _ in range(8)]
    reference.clear()
    depths = []
    launch = engine.launch

    def recording_launch(*args):
        depths.append(len(engine._in_flight))
        return launch(*args)
    engine.launch = recording_launch
    thread = ModelThread("test-model")
    try:
        pump = StepPump(StreamSession(engine, {}), thread)
        ids = np.fromiter(prompts, "<u8")
        futures = [pump.submit(StreamStep(1, np.zeros(0, "<u8"), first, np.zeros(0, "<u8"), None))]
        futures += [pump.submit(StreamStep(2 + i, np.zeros(0, "<u8"), [], ids, None)) for i in range(8)]
        outcomes = [f.result(timeout=120) for f in futures]
    finally:
        del engine.launch
        thread.shutdown()
    assert [o.step_id for o in outcomes] == list(range(1, 10))
    assert [_outputs(o.result) for o in outcomes] == want
    assert max(depths) == 1
    engine.clear()


def test_a_fault_reaches_every_waiting_step_and_the_pump_recovers(engines, monkeypatch):
    engine = engines[0]
    thread = ModelThread("test-model")
    try:
        pump = StepPump(StreamSession(engine, {}), thread)
        prompt = StreamStep(1, np.zeros(0, "<u8"), [PrefillInput(30, _prompt(30, 4), GREEDY, True)],
                            np.zeros(0, "<u8"), None)
        decode = StreamStep(2, np.zeros(0, "<u8"), [], np.array([30], "<u8"), None)
        assert pump.submit(prompt).result(timeout=60).result.outputs[0].token_id is not None

        def broken(step):
            raise RuntimeError("device lost")
        monkeypatch.setattr(engine, "collect", broken)
        futures = [pump.submit(decode) for _ in range(3)]
        for future in futures:
            with pytest.raises(RuntimeError, match="device lost"):
                future.result(timeout=60)
        monkeypatch.undo()
        engine._in_flight.clear()       # what the fault left behind: a worker restarts after one
        assert pump.submit(decode).result(timeout=60).result.outputs[0].error in ("", UNKNOWN_SEQUENCE)
    finally:
        thread.shutdown()
        engine._in_flight.clear()
        engine.clear()


def test_a_free_of_a_sequence_in_flight_waits_for_that_steps_collection(engines):
    """The router frees a sequence in step t+1 while step t, which holds it, may still run: step t still samples
    it (the free takes effect after t is collected), and t+1's decode of it is UNKNOWN_SEQUENCE -- what
    sequential steps give."""
    engine = engines[0]
    empty = np.zeros(0, "<u8")
    steps = [StreamStep(1, empty, [PrefillInput(40, _prompt(40, 5), GREEDY, True),
                                   PrefillInput(41, _prompt(41, 6), GREEDY, True)], empty, None),
             StreamStep(2, empty, [], np.array([40, 41], "<u8"), None),
             StreamStep(3, np.array([41], "<u8"), [], np.array([40, 41], "<u8"), None),
             StreamStep(4, empty, [], np.array([40], "<u8"), None)]
    sequential = StreamSession(engine, {})
    want = [_outputs(sequential.run(s).result) for s in steps]
    engine.clear()
    depths = []
    launch = engine.launch

    def recording_launch(*args):
        depths.append(len(engine._in_flight))
        return launch(*args)
    engine.launch = recording_launch
    thread = ModelThread("test-model")
    try:
        pump = StepPump(StreamSession(engine, {}), thread)
        got = [_outputs(f.result(timeout=60).result) for f in [pump.submit(s) for s in steps]]
    finally:
        del engine.launch
        thread.shutdown()
    assert depths[2] == 1, "step 3 was not launched while step 2 ran"
    assert got == want
    assert dict((r, e) for r, _, e in got[2])[41] == UNKNOWN_SEQUENCE and all(not e for _, _, e in got[1])
    engine.clear()
    assert engine.allocator.num_used_blocks == 0
