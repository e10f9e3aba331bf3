"""A stream's steps through StepPump, launched behind the step in flight whenever the engine allows it, answer
exactly what the same steps give one at a time (StreamSession.run), whatever a client sends: random mixes of
prompts in chunks, decodes, frees, sampled and scored sequences, unknown and duplicate ids, ids reused by the
step that frees them, chunks for sequences that already sample, KV pools too small for everyone, and rows whose
logits are non-finite (the engine releases those sequences when the step is collected, after the next step has
launched). The cpu engine of the tiny model, its overlap switched on."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import NON_FINITE_LOGITS, UNKNOWN_SEQUENCE, Engine, PrefillInput
from expert_service.engine.penalties import PenaltyParams
from expert_service.engine.sampling import SamplingParams
from expert_service.serving.lifecycle import ModelThread
from expert_service.serving.step_stream import StepPump, StepRequest, StreamSession
from tests.expert_service.engine.test_engine_overlap import Gate
from tests.helpers import cpu_engine

GREEDY = SamplingParams()
IDS = range(1, 8)
UNKNOWN_ID = 99


def _engine(model, overlap: bool, kv_cache_tokens: int, nan_every: int = 0) -> Engine:
    config = EngineConfig(
        backend="cpu", kv_block_size=4, kv_cache_tokens=kv_cache_tokens, max_batch_tokens=48, max_batch_size=6
    )
    engine = cpu_engine(ModelDir.open(model), config, overlap)
    if nan_every:  # the tiny model's logits are always finite: a row of a (token, position) hash is not
        forward = engine.decoder.forward

        def forward_with_nans(batch, trace=None):
            logits = forward(batch, trace)
            for row, source in enumerate(batch.logits_rows):
                if (int(batch.token_ids[source]) * 7 + int(batch.positions[source])) % nan_every == 0:
                    logits.array[row, 3] = np.nan
            return logits

        engine.decoder.forward = forward_with_nans
    return engine


def _step(step_id: int, frees=(), chunks=(), decodes=()) -> StepRequest:
    return StepRequest(step_id, np.asarray(frees, "<u8"), list(chunks), np.asarray(decodes, "<u8"), None)


def _view(outcome):
    """Everything a step's answer carries, comparable with ==."""
    if outcome.result is None:
        return "refused", outcome.refused, outcome.capacity
    return [
        (
            o.request_id,
            o.token_id,
            o.error,
            "nan" if np.isnan(o.logprob) else round(o.logprob, 5),  # a row with a NaN logit scores NaN
            None if o.top is None else o.top.top_ids.tolist(),
            None if o.prompt is None else o.prompt.top_ids.tolist(),
        )
        for o in outcome.result.outputs
    ]


def _state(engine: Engine):
    return (
        sorted((rid, s.num_cached, s.last_token) for rid, s in engine.sequences.items()),
        engine.allocator.num_used_blocks,
    )


def _one_at_a_time(engine: Engine, steps) -> tuple[list, StreamSession]:
    session = StreamSession(engine, {})
    return [_view(session.run(step)) for step in steps], session


def _pumped(engine: Engine, steps) -> tuple[list, list[int]]:
    """Every step queued before the pump starts (so each launch may go behind the one before); the stream is
    closed after them. Returns the answers and the steps in flight at each launch."""
    depths, launch = [], engine.launch

    def recording_launch(*args, **kwargs):
        depths.append(len(engine._in_flight))
        return launch(*args, **kwargs)

    engine.launch = recording_launch
    thread, faults = ModelThread("test-model"), []
    try:
        pump = StepPump(StreamSession(engine, {}), thread, on_fault=faults.append)
        gate = Gate(thread)
        futures = [pump.submit(step) for step in steps]
        closed = pump.close()
        gate.open()
        answers = [_view(f.result(timeout=60)) for f in futures]
        closed.result(timeout=60)
    finally:
        thread.shutdown()
    assert not faults
    return answers, depths


def _sampling(rng) -> SamplingParams:
    if rng.random() < 0.7:
        return GREEDY
    return [
        SamplingParams(temperature=0.9, seed=int(rng.integers(0, 9))),
        SamplingParams(logprobs=True, top_logprobs=int(rng.integers(0, 3))),
        SamplingParams(penalties=PenaltyParams(repetition=1.3, frequency=0.2)),
        SamplingParams(min_new_tokens=2, stop_token_ids=tuple(int(t) for t in rng.integers(0, 50, 5))),
        SamplingParams(prompt_logprobs=int(rng.integers(0, 3))),
    ][int(rng.integers(0, 5))]


def _random_steps(seed: int, vocab: int, count: int = 24) -> list[StepRequest]:
    """A client that mostly behaves (prompts, some in two chunks, then decodes; frees) and sometimes does not:
    unknown ids, out-of-vocabulary tokens, a new sequence without sampling parameters, a decode of what the
    step frees, duplicate decodes, a chunk for a sequence that already samples, an id reused by its free's step.
    Chunks say where they start as the client counts (so refusals leave later chunks past the engine's count)."""
    rng = np.random.default_rng(seed)
    sampling_ids, partial, steps = set(), set(), []
    sent: dict[int, int] = {}  # sequence -> its tokens sent so far
    for step_id in range(1, count + 1):
        frees, chunks, decodes, used = [], [], [], set()
        if rng.random() < 0.25 and (sampling_ids or partial):
            pool = sorted(sampling_ids | partial)
            frees = [int(r) for r in rng.choice(pool, size=min(len(pool), int(rng.integers(1, 3))), replace=False)]
            frees += [UNKNOWN_ID] * (rng.random() < 0.1) + frees[:1] * (rng.random() < 0.1)
            for rid in frees:
                sent.pop(rid, None)
            sampling_ids -= set(frees)
            partial -= set(frees)
        for _ in range(int(rng.integers(1, 3)) if rng.random() < 0.45 else 0):
            new_ids = [r for r in IDS if r not in sampling_ids | partial | used]
            if partial - used and rng.random() < 0.5:
                rid, sampling = int(rng.choice(sorted(partial - used))), None
            elif new_ids:
                rid, sampling = int(rng.choice(new_ids)), _sampling(rng)
            else:
                continue
            tokens = rng.integers(1, 200, int(rng.integers(1, 12)))
            if rng.random() < 0.03:
                tokens[0] = vocab
            if rng.random() < 0.03:
                sampling = None
            used.add(rid)
            chunks.append(PrefillInput(rid, tokens, sampling, bool(rng.random() < 0.7)))
        decodes = [r for r in sorted(sampling_ids) if r not in used and rng.random() < 0.8]
        if rng.random() < 0.2:
            decodes += [int(r) for r in rng.choice([*IDS, UNKNOWN_ID], size=int(rng.integers(1, 3)))]
        if rng.random() < 0.1 and sampling_ids - used:
            rid = int(rng.choice(sorted(sampling_ids - used)))
            used.add(rid)
            chunks.append(PrefillInput(rid, rng.integers(1, 200, 3), None, bool(rng.random() < 0.5)))
        if rng.random() < 0.1 and frees and frees[0] not in used:
            used.add(frees[0])
            chunks.append(PrefillInput(frees[0], rng.integers(1, 200, 5), _sampling(rng), True))
        for i, chunk in enumerate(chunks):
            (sampling_ids if chunk.is_last else partial).add(chunk.request_id)
            if chunk.is_last:
                partial.discard(chunk.request_id)
            start = 0 if chunk.sampling is not None else sent.get(chunk.request_id, 0)
            chunks[i] = replace(chunk, start_position=start)
            sent[chunk.request_id] = start + len(chunk.token_ids)
        for rid in decodes:
            sent[rid] = sent.get(rid, 0) + 1
        steps.append(_step(step_id, frees, chunks, [int(r) for r in rng.permutation(decodes)]))
    return steps


def _compare(model, seed: int) -> list[int]:
    """One random stream both ways; the launch depths of the pumped run."""
    kv_cache_tokens, nan_every = [24, 32, 48, 1024][seed % 4], [0, 17][seed // 4 % 2]
    reference = _engine(model, False, kv_cache_tokens, nan_every)
    overlapped = _engine(model, True, kv_cache_tokens, nan_every)
    steps = _random_steps(seed, reference.model_config.vocab_size)
    want, session = _one_at_a_time(reference, steps)
    got, depths = _pumped(overlapped, steps)
    for step, g, w in zip(steps, got, want):
        assert g == w, f"seed {seed}, step {step.step_id}"
    session.close()
    assert _state(overlapped) == _state(reference) == ([], 0)
    return depths


@pytest.mark.parametrize("seed", range(32))
def test_random_streams_answer_as_one_step_at_a_time(tiny_model, seed):
    _compare(tiny_model, seed)


def test_the_random_streams_do_run_steps_behind_others(tiny_model):
    """The comparison above means something only if launches do go behind a step in flight (the sampled and
    scored sequences and the refusals keep many from it)."""
    depths = [d for seed in range(100, 108) for d in _compare(tiny_model, seed)]
    assert sum(depths) / len(depths) > 0.25, depths


def _nan_at_position(engine: Engine, position: int) -> Engine:
    forward = engine.decoder.forward

    def forward_with_nan(batch, trace=None):
        logits = forward(batch, trace)
        for row, source in enumerate(batch.logits_rows):
            if batch.positions[source] == position:
                logits.array[row, 3] = np.nan
        return logits

    engine.decoder.forward = forward_with_nan
    return engine


@pytest.mark.parametrize(
    "third", ["chunk without sampling", "same id again", "decode twice", "decode", "decode, chunk never started"]
)
def test_a_sequence_released_for_non_finite_logits_is_gone_for_the_step_behind(tiny_model, third):
    """Step 2 samples position 5 of sequence 1, whose logits are non-finite: NON_FINITE_LOGITS, and the engine
    releases 1 when it collects step 2 -- after step 3 was launched behind it. Step 3 gets the answer it would
    get one step at a time: a refusal, a new sequence 1, UNKNOWN_SEQUENCE twice, UNKNOWN_SEQUENCE in its place
    (after the failure of a chunk whose sequence never started)."""
    last = {
        "chunk without sampling": _step(3, chunks=[PrefillInput(1, np.arange(1, 4), None, True)]),
        "same id again": _step(3, chunks=[PrefillInput(1, np.arange(1, 4), GREEDY, True)]),
        "decode twice": _step(3, decodes=[1, 1]),
        "decode": _step(3, chunks=[PrefillInput(2, np.arange(1, 4), GREEDY, True)], decodes=[1]),
        "decode, chunk never started": _step(
            3, chunks=[PrefillInput(5, np.arange(1, 4), None, True, start_position=4)], decodes=[1]
        ),
    }[third]
    steps = [_step(1, chunks=[PrefillInput(1, np.arange(10, 15), GREEDY, True)]), _step(2, decodes=[1]), last]
    want, _ = _one_at_a_time(_nan_at_position(_engine(tiny_model, False, 256), 5), steps)
    got, _ = _pumped(_nan_at_position(_engine(tiny_model, True, 256), 5), steps)
    assert got == want and want[1][0][2] == NON_FINITE_LOGITS
    if third == "decode":
        assert [o[0] for o in got[2]] == [2, 1] and got[2][1][2] == UNKNOWN_SEQUENCE
    if third == "decode, chunk never started":
        assert [(o[0], o[2]) for o in got[2]] == [(5, UNKNOWN_SEQUENCE), (1, UNKNOWN_SEQUENCE)]


def test_a_decode_that_needs_the_blocks_of_a_sequence_freed_behind_the_step_in_flight(tiny_model):
    """An 8-block pool, full after step 2; step 3 frees B (held by step 2, so the free waits for its collection)
    and decodes A, which needs a fifth block: B's. One step at a time it runs; the pump, refused for KV blocks
    at first, collects step 2 (B's blocks come back) and launches step 3 again."""
    rng = np.random.default_rng(0)
    steps = [
        _step(
            1,
            chunks=[
                PrefillInput(1, rng.integers(1, 200, 15), GREEDY, True),
                PrefillInput(2, rng.integers(1, 200, 14), GREEDY, True),
            ],
        ),
        _step(2, decodes=[1, 2]),
        _step(3, frees=[2], decodes=[1]),
        _step(4, decodes=[1]),
    ]
    want, _ = _one_at_a_time(_engine(tiny_model, False, 32), steps)
    got, depths = _pumped(_engine(tiny_model, True, 32), steps)
    assert got == want and all(not error for answer in want for _, _, error, *_ in answer)
    assert depths == [0, 1, 1, 0, 1], "step 3: launched behind step 2, refused, launched again alone"


def test_an_id_freed_twice_in_one_step_is_freed_once(tiny_model):
    steps = [
        _step(1, chunks=[PrefillInput(1, np.arange(1, 6), GREEDY, True)]),
        _step(2, chunks=[PrefillInput(2, np.arange(1, 6), GREEDY, True)], decodes=[1]),
        _step(3, frees=[2, 2, 1, 1], decodes=[1, 2]),
    ]
    want, _ = _one_at_a_time(_engine(tiny_model, False, 256), steps)
    got, _ = _pumped(_engine(tiny_model, True, 256), steps)
    assert got == want and [(o[0], o[2]) for o in want[2]] == [(1, UNKNOWN_SEQUENCE), (2, UNKNOWN_SEQUENCE)]
