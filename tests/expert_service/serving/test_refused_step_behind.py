"""What a step refused as a whole does to the step the router pipelined behind it, built before the refusal was
known. The router fails the refused step's requests when its answer comes, but the step behind already carries
their next prompt chunks and decodes: those fail alone (each chunk says where it starts, so the engine sees that
an earlier one never ran), and every other sequence of the step runs as it would have without them. A start
position that is wrong for any other reason refuses the step, naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from expert_service.engine.engine import (
    EARLIER_CHUNK_REFUSED,
    UNKNOWN_PREFIX_BLOCK,
    UNKNOWN_SEQUENCE,
    PrefillInput,
)
from tests.expert_service.serving.test_step_pump_differential import GREEDY, _engine, _one_at_a_time, _pumped, _step

BLOCK = 4  # _engine's kv_block_size
GOODS = (3, 4)  # the sequences that have nothing to do with the refusal


def _ids(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n)


def _errors(answer) -> dict[int, str]:
    assert answer[0] != "refused", answer
    return {rid: error for rid, _, error, *_ in answer}


def _tokens(answers, rid: int) -> list[int]:
    return [t for answer in answers if answer[0] != "refused" for r, t, *_ in answer if r == rid and t is not None]


def test_the_next_chunk_of_a_sequence_a_refused_step_started_fails_alone(tiny_model):
    engine = _engine(tiny_model, False, 256)
    vocab = engine.model_config.vocab_size
    steps = [
        # 1's first chunk, refused with the step (2's token is outside the vocabulary)
        _step(
            1, chunks=[PrefillInput(1, _ids(10, 8), GREEDY, False), PrefillInput(2, np.array([vocab]), GREEDY, True)]
        ),
        # sent before that answer: 1's next chunk, and 3, which has nothing to do with it
        _step(2, chunks=[PrefillInput(1, _ids(18, 4), None, True, start_position=8),
                         PrefillInput(3, _ids(30, 5), GREEDY, True)]),
    ]  # fmt: skip
    answers, _ = _one_at_a_time(engine, steps)
    assert answers[0][0] == "refused"
    assert answers[1][0] != "refused", answers[1]
    errors = {rid: error for rid, _, error, *_ in answers[1]}
    assert errors == {1: UNKNOWN_SEQUENCE, 3: ""}
    assert 1 not in engine.sequences


def test_a_chunk_after_a_refused_one_of_a_cached_prompt_fails_alone(tiny_model):
    """With prefix caching: 1's chunk in step 2 is refused, so the worker's sequence stays 4 tokens long while
    step 3's chunk starts at 10 and names ids for the blocks tokens 10-15 complete (2); it fails alone, and
    registers nothing."""
    engine = _engine(tiny_model, False, 256)
    vocab = engine.model_config.vocab_size
    steps = [
        _step(1, chunks=[PrefillInput(1, _ids(10, 4), GREEDY, False, cache_block_ids=(11,))]),
        _step(2, chunks=[PrefillInput(1, _ids(14, 6), None, False, cache_block_ids=(12,), start_position=4)]
              + [PrefillInput(2, np.array([vocab]), GREEDY, True)]),
        _step(3, chunks=[PrefillInput(1, _ids(20, 6), None, True, cache_block_ids=(13, 14), start_position=10)]
              + [PrefillInput(3, _ids(30, 5), GREEDY, True)]),
    ]  # fmt: skip
    answers, session = _one_at_a_time(engine, steps)
    assert answers[1][0] == "refused"
    assert answers[2][0] != "refused", answers[2]
    assert {rid: error for rid, _, error, *_ in answers[2]}[3] == ""
    assert _errors(answers[2]) == {1: EARLIER_CHUNK_REFUSED, 3: ""}
    assert engine.sequences[1].num_cached == 4  # held until the router frees it
    assert {block_id for owner, block_id in engine.allocator.cached if owner == session.id} == {11}


@pytest.mark.parametrize("chunks_before", [0, 1])
def test_the_decode_behind_a_refused_last_chunk_fails_alone(tiny_model, chunks_before):
    """1's prompt ends in the refused step (its only chunk, or its second): the decode the router sent behind it
    has no token to feed and fails alone; 3, new in the same step, runs."""
    engine = _engine(tiny_model, False, 256)
    vocab = engine.model_config.vocab_size
    first = [_step(1, chunks=[PrefillInput(1, _ids(10, 5), GREEDY, False)])] if chunks_before else []
    last = PrefillInput(1, _ids(15, 3), None if chunks_before else GREEDY, True, start_position=5 * chunks_before)
    steps = [
        *first,
        _step(2, chunks=[last, PrefillInput(2, np.array([vocab]), GREEDY, True)]),
        _step(3, chunks=[PrefillInput(3, _ids(30, 5), GREEDY, True)], decodes=[1]),
    ]
    answers, _ = _one_at_a_time(engine, steps)
    assert answers[-2][0] == "refused"
    assert _errors(answers[-1]) == {1: UNKNOWN_SEQUENCE, 3: ""}


def test_a_first_chunk_on_blocks_a_refused_step_was_to_register_fails_alone_and_so_does_its_next(tiny_model):
    """Step 1 was to register blocks 11 and 12 and is refused; step 2 (sent before its answer) starts 4 on them,
    and step 3 (sent before step 2's answer) carries 4's next chunk: each fails alone, 3 runs on."""
    engine = _engine(tiny_model, False, 256)
    vocab = engine.model_config.vocab_size
    steps = [
        _step(1, chunks=[PrefillInput(1, _ids(10, 8), GREEDY, False, cache_block_ids=(11, 12)),
                         PrefillInput(2, np.array([vocab]), GREEDY, True)]),
        _step(2, chunks=[PrefillInput(1, _ids(18, 3), None, True, start_position=8),
                         PrefillInput(4, _ids(18, 2), GREEDY, False, prefix_block_ids=(11, 12), start_position=8),
                         PrefillInput(3, _ids(40, 6), GREEDY, True)]),
        _step(3, frees=[1, 2], chunks=[PrefillInput(4, _ids(20, 2), None, True, start_position=10)], decodes=[3]),
    ]  # fmt: skip
    answers, session = _one_at_a_time(engine, steps)
    assert answers[0][0] == "refused"
    assert _errors(answers[1]) == {1: UNKNOWN_SEQUENCE, 4: UNKNOWN_PREFIX_BLOCK, 3: ""}
    assert _errors(answers[2]) == {4: UNKNOWN_SEQUENCE, 3: ""}
    assert sorted(engine.sequences) == [3] and not engine.allocator.cached


def _scenario(rng, vocab: int):
    """A router's steps around one refusal, at a random pipeline depth: sequence 1's prompt in chunks (some naming
    cache ids), the one at `lost` refused with its step (its own bad token, or 2's); the steps sent before that
    answer carry 1's next chunks (then its decode) with the prompts of 3 and 4, then their decodes; the step
    after the answer frees 1 and 2. Returns the steps, the index of the refused one, 1's error in each step
    behind it, and the prompts of 3 and 4."""
    prompt = rng.integers(1, 200, int(rng.integers(6, 20)))
    cuts = sorted(rng.choice(np.arange(1, len(prompt)), size=int(rng.integers(1, 4)), replace=False).tolist())
    pieces, starts = np.split(prompt, cuts), [0, *cuts]
    lost, depth, cache = int(rng.integers(0, len(pieces))), int(rng.integers(2, 5)), bool(rng.random() < 0.5)
    own_bad = bool(rng.random() < 0.5)
    block_ids = iter(range(100, 200))
    goods = {rid: rng.integers(1, 200, int(rng.integers(2, 9))) for rid in GOODS}

    def chunk(i: int) -> PrefillInput:
        start, n = starts[i], len(pieces[i])
        ids = tuple(next(block_ids) for _ in range((start + n) // BLOCK - start // BLOCK)) if cache else ()
        tokens = pieces[i].copy()
        if i == lost and own_bad:
            tokens[-1] = vocab
        return PrefillInput(1, tokens, GREEDY if i == 0 else None, i == len(pieces) - 1, (), ids, (), start)

    steps = [_step(i + 1, chunks=[chunk(i)]) for i in range(lost)]
    refused = [chunk(lost)] + ([] if own_bad else [PrefillInput(2, np.array([vocab]), GREEDY, True)])
    steps.append(_step(lost + 1, chunks=refused))
    behind, errors = [chunk(i) for i in range(lost + 1, len(pieces))], []
    for k in range(depth - 1):  # sent before the refusal's answer: 1's next chunk, or its decode once all are out
        ones = [behind.pop(0)] if behind else []
        errors.append(UNKNOWN_SEQUENCE if not ones or lost == 0 else EARLIER_CHUNK_REFUSED)
        goods_in = [PrefillInput(rid, tokens, GREEDY, True) for rid, tokens in goods.items()] if k == 0 else []
        steps.append(_step(len(steps) + 1, chunks=ones + goods_in, decodes=([] if ones else [1]) + [*GOODS] * (k > 0)))
    for k in range(3):
        steps.append(_step(len(steps) + 1, frees=[1, 2] if k == 0 else [], decodes=list(GOODS)))
    return steps, lost, errors, goods


@pytest.mark.parametrize("seed", range(12))
def test_random_refusals_fail_only_their_sequences_behind_them(tiny_model, seed):
    """Whatever chunk of 1 the refusal takes and however deep the pipeline: every step behind runs, 1 fails alone
    in each, and 3 and 4 get the tokens they get alone; the pump, launching steps behind others, answers the
    same; nothing is left once the stream ends."""
    rng = np.random.default_rng(seed)
    engine = _engine(tiny_model, False, 256)
    steps, lost, errors, goods = _scenario(rng, engine.model_config.vocab_size)
    answers, session = _one_at_a_time(engine, steps)
    assert answers[lost][0] == "refused"
    for answer, error in zip(answers[lost + 1 :], errors + [None] * 3):
        assert _errors(answer) == {**({1: error} if error else {}), 3: "", 4: ""}, answer
    alone = _engine(tiny_model, False, 256)
    for rid, prompt in goods.items():
        got = _tokens(answers, rid)
        assert got == alone.generate(prompt, len(got))[0], rid
    cached = {block_id for owner, block_id in engine.allocator.cached if owner == session.id}
    assert cached == {b for step in steps[:lost] for c in step.chunks for b in c.cache_block_ids}
    pumped, depths = _pumped(_engine(tiny_model, True, 256), steps)
    assert pumped == answers and max(depths) == 1  # some step did launch behind another
    session.close()
    assert not engine.sequences and not engine.allocator.cached and engine.allocator.num_used_blocks == 0


def _two_chunks_run():
    return [
        _step(1, chunks=[PrefillInput(1, _ids(10, 5), GREEDY, False)]),
        _step(2, chunks=[PrefillInput(1, _ids(15, 3), None, False, start_position=5)]),
    ]


@pytest.mark.parametrize("seed", range(6))
def test_a_wrong_start_for_a_live_sequence_refuses_the_step_naming_the_field(tiny_model, seed):
    """1 holds 8 tokens and lost no chunk: a chunk starting anywhere else (before, or past without a refusal
    behind it) refuses the step, one line naming start_position, and 3 in it does not start; the right start
    runs. After a refusal, a start before the engine's count is still refused."""
    rng = np.random.default_rng(seed)
    engine = _engine(tiny_model, False, 256)
    wrong = int(rng.choice([*range(1, 8), *range(9, 40)]))
    good = PrefillInput(3, rng.integers(1, 200, 4), GREEDY, True)

    def step(step_id, start):
        return _step(step_id, chunks=[PrefillInput(1, rng.integers(1, 200, 3), None, True, start_position=start), good])

    answers, session = _one_at_a_time(engine, _two_chunks_run())
    refused = session.run(step(3, wrong))
    assert refused.result is None and refused.refused.startswith("start_position") and "\n" not in refused.refused
    assert 3 not in engine.sequences and engine.sequences[1].num_cached == 8
    before = int(rng.integers(1, 8))  # 1 lost the chunk of step 3: a start past 8 fails alone, before 8 does not
    assert session.run(step(4, before)).refused.startswith("start_position")
    assert not session.run(step(5, 8)).refused and engine.sequences[1].last_token is not None


@pytest.mark.parametrize(("prefix_blocks", "wrong"), [(0, (1, 3)), (2, (4, 7, 9))])
def test_a_first_chunk_must_start_after_the_blocks_it_names(tiny_model, prefix_blocks, wrong):
    engine = _engine(tiny_model, False, 256)
    warm = [_step(1, chunks=[PrefillInput(9, _ids(10, 9), GREEDY, True, cache_block_ids=(21, 22))])]
    _, session = _one_at_a_time(engine, warm)
    names, right = (21, 22)[:prefix_blocks], BLOCK * prefix_blocks
    for start in wrong:
        chunk = PrefillInput(5, _ids(18, 2), GREEDY, True, prefix_block_ids=names, start_position=start)
        answer = session.run(_step(2, chunks=[chunk]))
        assert answer.refused.startswith("start_position") and "is new" in answer.refused, start
    assert 5 not in engine.sequences
    chunk = PrefillInput(5, _ids(18, 2), GREEDY, True, prefix_block_ids=names, start_position=right)
    assert not session.run(_step(3, chunks=[chunk])).refused and engine.sequences[5].num_cached == right + 2


def test_a_later_chunk_without_a_start_runs_where_the_engine_is(tiny_model):
    """Routers before the field send 0: the chunk continues at the engine's count, as it always did."""
    given = _one_at_a_time(_engine(tiny_model, False, 256), _two_chunks_run())[0]
    old = [_two_chunks_run()[0], _step(2, chunks=[PrefillInput(1, _ids(15, 3), None, False)])]
    assert _one_at_a_time(_engine(tiny_model, False, 256), old)[0] == given


def test_a_chunk_refused_behind_the_step_in_flight_and_launched_again_loses_nothing(tiny_model):
    """An 8-block pool, full after step 2; step 3 frees 2 and carries 3's third chunk, which needs a block of 2's.
    Launched behind step 2 it is refused for KV blocks, launched again once step 2 is collected it runs (its
    position checked again, not taken for a lost chunk); so 3's last chunk, at the position after it, runs too."""
    rng = np.random.default_rng(0)
    steps = [
        _step(1, chunks=[PrefillInput(1, rng.integers(1, 200, 11), GREEDY, True),
                         PrefillInput(2, rng.integers(1, 200, 11), GREEDY, True),
                         PrefillInput(3, rng.integers(1, 200, 4), GREEDY, False)]),
        _step(2, chunks=[PrefillInput(3, rng.integers(1, 200, 4), None, False, start_position=4)], decodes=[1, 2]),
        _step(3, frees=[2], chunks=[PrefillInput(3, rng.integers(1, 200, 4), None, False, start_position=8)]),
        _step(4, chunks=[PrefillInput(3, rng.integers(1, 200, 2), None, True, start_position=12)], decodes=[1]),
    ]  # fmt: skip
    want, _ = _one_at_a_time(_engine(tiny_model, False, 32), steps)
    got, depths = _pumped(_engine(tiny_model, True, 32), steps)
    assert got == want and all(not error for answer in want for _, _, error, *_ in answer)
    assert depths == [0, 1, 1, 0, 1], "step 3: launched behind step 2, refused, launched again alone"


@pytest.mark.gpu
def test_random_refusals_on_the_cuda_engine(tmp_path):
    """The random scenarios on the cuda backend, whose steps overlap on the device (a decode behind the step in
    flight reads its token from that step's argmax): the pump answers as one step at a time, 1 fails alone in
    every step behind the refused one, and 3 and 4 get the tokens they get alone."""
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.tools.tiny_model import make_tiny

    model = make_tiny(tmp_path / "m", family="mixtral", seed=5)
    config = EngineConfig(
        backend="cuda", kv_block_size=BLOCK, kv_cache_tokens=256, max_batch_tokens=48, max_batch_size=6
    )
    sequential, overlapped, alone = (build_engine(ModelDir.open(model), config) for _ in range(3))
    try:
        for seed in range(8):
            steps, lost, errors, goods = _scenario(np.random.default_rng(seed), sequential.model_config.vocab_size)
            answers, session = _one_at_a_time(sequential, steps)
            assert answers[lost][0] == "refused", seed
            for answer, error in zip(answers[lost + 1 :], errors + [None] * 3):
                assert _errors(answer) == {**({1: error} if error else {}), 3: "", 4: ""}, (seed, answer)
            for rid, prompt in goods.items():
                got = _tokens(answers, rid)
                assert got == alone.generate(prompt, len(got))[0], (seed, rid)
            pumped, depths = _pumped(overlapped, steps)
            assert pumped == answers and max(depths) == 1, seed
            session.close()
            for engine in (sequential, overlapped):
                assert not engine.sequences and engine.allocator.num_used_blocks == 0, seed
    finally:
        for engine in (sequential, overlapped, alone):
            engine.close()
