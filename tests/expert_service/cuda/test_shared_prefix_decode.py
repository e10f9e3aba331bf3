"""Decode steps whose sequences share cached prompt blocks (one sequence registers a system prompt's blocks, five more
start on them, one runs another prompt) with CudaOptions.shared_prefix_attention against without it, on a bf16 tiny
Mixtral (4 heads on 2 kv heads: groups of up to 8 sequences). GPU only."""

import numpy as np
import pytest

import expert_service.cuda.decoder as cuda_decoder
import expert_service.cuda.model as cuda_model
from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.cuda_options import CudaOptions
from expert_service.engine.engine import PrefillInput
from expert_service.engine.sampling import SamplingParams
from tests.helpers import bf16_tiny, rel_error

pytestmark = pytest.mark.gpu

BLOCK = 16
SYSTEM = 96  # six blocks: above shared_prefix.MIN_SHARED_KEYS
CFG = dict(kv_block_size=BLOCK, kv_cache_tokens=4096, max_batch_tokens=512, max_batch_size=16)
ON, OFF = CudaOptions(shared_prefix_attention=True), CudaOptions()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return bf16_tiny(tmp_path_factory.mktemp("shared"), "mixtral", 21)


def engine_of(model, **config):
    return build_engine(ModelDir.open(model), EngineConfig(backend="cuda", cuda_options=ON, **CFG, **config))


def shared_run(engine, options: CudaOptions, seed: int, steps: int = 6):
    """The seven sequences prefilled (the system prompt's blocks registered by sequence 0 and reused by 1-5), then
    `steps` decode steps of them all: [(token ids, logits [7, V])] a step."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 250, SYSTEM)
    ids = tuple(range(100, 100 + SYSTEM // BLOCK))
    if engine.decoder.options != options:  # set_options drops the graphs: warm-up's would be captured again
        engine.decoder.set_options(options)
    first = np.concatenate([system, rng.integers(3, 250, 10)])
    engine.step([PrefillInput(0, first, SamplingParams(), True, cache_block_ids=ids)])
    turns = [
        PrefillInput(r, rng.integers(3, 250, int(rng.integers(1, 40))), SamplingParams(), True, prefix_block_ids=ids)
        for r in range(1, 6)
    ]
    engine.step([*turns, PrefillInput(6, rng.integers(3, 250, 120), SamplingParams(), True)])
    run = []
    for _ in range(steps):
        step = engine.step(decode_ids=list(range(7)))
        run.append(([o.token_id for o in step.outputs], np.stack(list(step.logits))))
    engine.clear()
    return run


def count_shared_launches(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = cuda_model.launch_attention_decode_shared
    monkeypatch.setattr(
        cuda_model, "launch_attention_decode_shared", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    return calls


def count_groups(monkeypatch) -> list[int]:
    """The groups each staged step found (a replayed graph calls no launcher, but every step is staged)."""
    groups: list[int] = []
    original = cuda_decoder.stage_step
    monkeypatch.setattr(cuda_decoder, "stage_step", lambda *a, **k: groups.append(original(*a, **k)) or groups[-1])
    return groups


def assert_sharing_changes_only_rounding(engine, monkeypatch, seed: int):
    calls = count_shared_launches(monkeypatch)
    off = shared_run(engine, OFF, seed=seed)
    assert not calls
    on = shared_run(engine, ON, seed=seed)
    assert calls, "no decode step took the shared-prefix attention"
    for i, ((ta, la), (tb, lb)) in enumerate(zip(off, on)):
        # the kernel test's bound on the attention output (bf16 q and P), carried through two layers
        assert rel_error(lb, la) <= 2e-2, f"decode step {i}: {rel_error(lb, la):.2e}"
        if ta != tb:  # only at a near-tie of the unshared logits; the sequences part from here on
            chosen = la[np.arange(len(tb)), tb]
            assert np.all(la.max(axis=1) - chosen <= 2e-2 * np.abs(la).max()), f"decode step {i}: {ta} vs {tb}"
            break


def assert_graphs_replay_the_eager_pass(model, seed: int, **config):
    graphs, eager = engine_of(model, **config), engine_of(model, cuda_graphs=False, **config)
    for i, ((ta, la), (tb, lb)) in enumerate(zip(shared_run(graphs, ON, seed), shared_run(eager, ON, seed))):
        assert ta == tb, f"decode step {i}"
        np.testing.assert_array_equal(la, lb)
    graphs.close()
    eager.close()


def test_shared_prefixes_give_the_unshared_tokens_and_logits(model, monkeypatch):
    engine = engine_of(model)
    assert_sharing_changes_only_rounding(engine, monkeypatch, seed=1)
    engine.close()


def test_graph_replay_equals_the_eager_pass(model):
    assert_graphs_replay_the_eager_pass(model, seed=2)


def test_an_expert_cache_engine_shares_alike(model, monkeypatch):
    """Experts in the expert cache (2 of 4 slots a layer: misses served mid-step) leave attention as it is: the
    shared prefixes change only its rounding, and the graphs replay the eager pass bit for bit."""
    engine = engine_of(model, expert_cache_slots=2)
    assert engine.decoder.cached is not None
    assert_sharing_changes_only_rounding(engine, monkeypatch, seed=5)
    engine.close()
    assert_graphs_replay_the_eager_pass(model, seed=6, expert_cache_slots=2)


def test_no_device_allocations_while_sharing(model, monkeypatch):
    from cuda.bindings import driver as drv
    from numba.cuda.cudadrv import driver

    engine = engine_of(model)
    engine.warmup()  # captures each decode bucket with and without shared prefixes
    groups = count_groups(monkeypatch)
    shared_run(engine, ON, seed=3, steps=1)  # the kernels and graphs of this shape, once
    free_before = drv.cuMemGetInfo()[1]
    allocations = []
    original = driver.Context.memalloc
    monkeypatch.setattr(
        driver.Context, "memalloc", lambda self, *a, **k: allocations.append(a) or original(self, *a, **k)
    )
    shared_run(engine, ON, seed=4)
    assert max(groups) == 1 and allocations == [], f"{len(allocations)} device allocations during steps"
    assert drv.cuMemGetInfo()[1] == free_before
    engine.close()
