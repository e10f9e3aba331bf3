"""The cuda backend's DevicePenalties against the cpu backend's HostPenalties over several steps (resets,
prompt marks, output counts, penalised and unpenalised rows): in Numba's simulator, and at a real vocabulary
size on a GPU."""

from __future__ import annotations

import types

import numpy as np
import pytest
from numba import cuda

from expert_service.cpu.penalties import HostPenalties
from expert_service.cuda.penalties import DevicePenalties
from expert_service.engine.penalties import PenaltyParams, PenaltySlots
from expert_service.kernels.greedy_split import parts


def _workspace(rows: int, vocab: int):
    """The workspace arrays DevicePenalties writes its argmax into, pre-filled so unwritten values show."""
    p = parts(vocab)
    return types.SimpleNamespace(
        greedy_ids=cuda.to_device(np.full(rows, -1, np.int32)),
        nonfinite=cuda.to_device(np.full(rows, -1, np.int32)),
        greedy_part_values=cuda.device_array((rows, p), np.float32),
        greedy_part_ids=cuda.device_array((rows, p), np.int32),
        greedy_part_flags=cuda.device_array((rows, p), np.int32),
    )


def _compare(vocab: int, steps: int, seed=None):
    rng = np.random.default_rng(seed)
    num_slots, max_rows = 3, 4
    stream = cuda.stream()
    ws = _workspace(max_rows, vocab)
    device = DevicePenalties(num_slots, vocab, max_rows, 64, ws, stream)
    host, slots = HostPenalties(num_slots, vocab), PenaltySlots(num_slots)
    params = {
        1: PenaltyParams(1.3, 0.4, 0.2),
        2: PenaltyParams(),
        3: PenaltyParams(0.8, -0.5, 1.1),
        4: PenaltyParams(repetition=2.0),
    }
    last = {}
    for step in range(steps):
        builder = slots.builder()
        if step == 0:
            for rid in (1, 3):
                builder.reset(slots.acquire(rid))
        if step == 2:  # sequence 1 leaves; 4 takes its slot, which must start from zero
            slots.release(1)
            builder.reset(slots.acquire(4))
            del last[1]
        rids = [rid for rid in (1, 2, 3, 4) if (rid != 1 or step < 2) and (rid != 4 or step >= 2)]
        for rid in rids:
            if rid in last:
                builder.output(rid, last[rid])
            else:
                builder.prompt(rid, rng.integers(0, vocab, 7))
            builder.row(rid, params[rid])
        batch = builder.build()
        logits = (rng.standard_normal((len(rids), vocab)) * 3).astype(np.float32)
        want = host.apply(batch, logits)
        n = device.apply(batch, cuda.to_device(logits, stream=stream))
        assert n == len(rids)
        got = device.download(n)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(ws.greedy_ids.copy_to_host()[:n], np.argmax(want, axis=1))
        assert not ws.nonfinite.copy_to_host()[:n].any()
        np.testing.assert_array_equal(device.words.copy_to_host(), host.words)
        for r, rid in enumerate(rids):
            last[rid] = int(np.argmax(want[r])) if rng.random() < 0.5 else last.get(rid, 0)


def test_device_penalties_match_the_host_over_steps():
    _compare(vocab=41, steps=5)


def test_a_step_of_updates_only_writes_no_rows():
    stream = cuda.stream()
    device = DevicePenalties(2, 30, 2, 16, _workspace(2, 30), stream)
    slots = PenaltySlots(2)
    builder = slots.builder()
    builder.reset(slots.acquire(7))
    builder.prompt(7, np.array([3, 3, 29]))  # a prompt chunk that does not end its prompt
    batch = builder.build()
    assert device.apply(batch, cuda.to_device(np.zeros((0, 30), np.float32))) == 0
    words = device.words.copy_to_host()
    assert words[slots.slots[7], [3, 29]].tolist() == [1, 1] and words.sum() == 2


def test_a_step_of_rows_without_updates_matches_the_host():
    """A presence/frequency-only sequence's prompt marks nothing: the step that starts it and samples its first
    token has a reset and a row but no update, and penalises nothing yet (no output counted)."""
    rng = np.random.default_rng()
    stream, vocab = cuda.stream(), 43
    ws = _workspace(2, vocab)
    device, host, slots = DevicePenalties(2, vocab, 2, 16, ws, stream), HostPenalties(2, vocab), PenaltySlots(2)
    builder = slots.builder()
    builder.reset(slots.acquire(5))
    builder.row(5, PenaltyParams(presence=float(rng.uniform(0.1, 2)), frequency=float(rng.uniform(0.1, 2))))
    batch = builder.build()
    assert batch is not None and len(batch.update_slots) == 0
    logits = (rng.standard_normal((1, vocab)) * 3).astype(np.float32)
    want = host.apply(batch, logits)
    assert device.apply(batch, cuda.to_device(logits, stream=stream)) == 1
    np.testing.assert_array_equal(device.download(1), want)
    np.testing.assert_array_equal(want, logits)
    assert ws.greedy_ids.copy_to_host()[0] == np.argmax(logits[0]) and not device.words.copy_to_host().any()


def test_warmup_runs_every_penalty_kernel_and_leaves_no_state(monkeypatch):
    """Warm-up launches the update, apply and argmax kernels once (so serving compiles none of them) and
    leaves every slot as zero as it found it."""
    import expert_service.cuda.penalties as module

    launched = []
    for name in ("launch_penalty_update", "launch_apply_penalties", "launch_greedy_split"):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: launched.append(_n) or _f(*a, **k))
    stream, vocab = cuda.stream(), 37
    device = DevicePenalties(3, vocab, 2, 8, _workspace(2, vocab), stream)
    device.warmup(cuda.to_device((np.random.default_rng().standard_normal((2, vocab))).astype(np.float32)))
    assert sorted(set(launched)) == ["launch_apply_penalties", "launch_greedy_split", "launch_penalty_update"]
    assert not device.words.copy_to_host().any()


def test_the_planned_bytes_are_what_is_allocated():
    """The start-up device-memory check sizes the penalties before any exist."""
    device = DevicePenalties(3, 41, 4, 64, _workspace(4, 41), cuda.stream())
    assert DevicePenalties.planned_nbytes(3, 41, 4, 64) == device.nbytes


@pytest.mark.gpu
def test_device_penalties_match_the_host_at_a_real_vocabulary():
    _compare(vocab=151936, steps=6, seed=0)


# --- the cuda decoder with penalties (GPU) -------------------------------------------------------------------
ENGINE = dict(kv_block_size=8, kv_cache_tokens=4096, max_batch_tokens=512, max_batch_size=16)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """cpu, cuda (graphs) and cuda (eager) engines of one tiny model."""
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.tools.tiny_model import make_tiny

    model = make_tiny(tmp_path_factory.mktemp("penalties") / "m", family="qwen3_moe", seed=5)
    return [
        build_engine(ModelDir.open(model), EngineConfig(backend=backend, cuda_graphs=graphs, **ENGINE))
        for backend, graphs in (("cpu", True), ("cuda", True), ("cuda", False))
    ]


def _run_mixed(engine, steps: int = 6):
    """Three sequences (two penalised, one not, one with top/prompt log-probabilities) prefilled together,
    then decoded: (tokens per step, processed rows per step, log-probabilities per step)."""
    from expert_service.engine.engine import PrefillInput
    from expert_service.engine.sampling import SamplingParams

    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 259, n) for n in (9, 14, 5)]
    sampling = [
        SamplingParams(penalties=PenaltyParams(1.3, 0.4, 0.6)),
        SamplingParams(),
        SamplingParams(
            logprobs=True, top_logprobs=4, prompt_logprobs=2, penalties=PenaltyParams(repetition=0.8, frequency=1.0)
        ),
    ]
    result = engine.step([PrefillInput(i, p, s, True) for i, (p, s) in enumerate(zip(prompts, sampling))])
    tokens, rows, scores = [], [], []
    for _ in range(steps):
        tokens.append([o.token_id for o in result.outputs])
        rows.append(np.stack([result.logits.processed(r) for r in range(3)]))
        scores.append((result.outputs[2].logprob, result.outputs[2].top, result.outputs[2].prompt))
        result = engine.step(decode_ids=[0, 1, 2])
    engine.clear()
    assert not engine.penalty_slots.slots and engine.allocator.num_used_blocks == 0
    return tokens, rows, scores


@pytest.mark.gpu
def test_cuda_penalties_and_logprobs_match_cpu(engines):
    from tests.helpers import rel_error

    cpu, gpu, _ = engines
    (ct, cr, cs), (gt, gr, gs) = _run_mixed(cpu), _run_mixed(gpu)
    assert gt == ct
    for a, b in zip(gr, cr):
        assert rel_error(a, b) <= 1e-4
    for (clp, ctop, cprompt), (glp, gtop, gprompt) in zip(cs, gs):
        assert glp == pytest.approx(clp, abs=1e-3) and gtop.top_ids.tolist() == ctop.top_ids.tolist()
        if cprompt is not None:
            np.testing.assert_allclose(gprompt.logprobs[1:], cprompt.logprobs[1:], atol=1e-3)


@pytest.mark.gpu
def test_graph_replay_equals_eager_with_penalties(engines):
    _, graphs, eager = engines
    a, b = _run_mixed(graphs, steps=8), _run_mixed(eager, steps=8)
    assert 4 in graphs.decoder.graphs, "decode steps did not replay a CUDA graph"
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1]):
        assert np.array_equal(x, y)


@pytest.mark.gpu
def test_penalised_steps_allocate_nothing_on_the_device(engines, monkeypatch):
    from cuda.bindings import driver as drv
    from numba.cuda.cudadrv import driver

    _, gpu, _ = engines
    gpu.warmup()
    _run_mixed(gpu, steps=2)  # first use: kernels load
    free_before = drv.cuMemGetInfo()[1]
    calls = []
    original = driver.Context.memalloc
    monkeypatch.setattr(driver.Context, "memalloc", lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    _run_mixed(gpu, steps=4)
    assert calls == [] and drv.cuMemGetInfo()[1] == free_before


@pytest.mark.gpu
def test_penalised_steps_compile_nothing_after_warmup(engines):
    from expert_service.kernels import apply_penalties, penalty_update

    _, gpu, _ = engines
    gpu.warmup()
    kernels = (penalty_update._penalty_update, apply_penalties._apply_penalties)
    compiled = [len(k.overloads) for k in kernels]
    assert all(compiled), compiled
    _run_mixed(gpu, steps=2)
    assert [len(k.overloads) for k in kernels] == compiled


@pytest.mark.gpu
def test_penalties_on_the_all_rows_path_match_cpu(engines):
    """Prompt scoring rows past max_batch_size take the cuda decoder's chunked head: the penalised sampling
    rows still come from the device penalties."""
    from expert_service.engine.engine import PrefillInput
    from expert_service.engine.sampling import SamplingParams

    cpu, gpu, _ = engines
    out = []
    for engine in (cpu, gpu):
        params = SamplingParams(logprobs=True, prompt_logprobs=1, penalties=PenaltyParams(1.5, 1.0, 1.0))
        steps = [
            engine.step(
                [
                    PrefillInput(0, np.arange(3, 19), params, True),
                    PrefillInput(1, np.arange(40, 55), SamplingParams(penalties=PenaltyParams(2.0)), True),
                ]
            )
        ]
        steps += [engine.step(decode_ids=[0, 1]) for _ in range(4)]
        out.append([[o.token_id for o in s.outputs] for s in steps])
        engine.clear()
    assert out[0] == out[1]
