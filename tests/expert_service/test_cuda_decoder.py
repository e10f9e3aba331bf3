"""The cuda backend against the fp32 CPU reference on tiny models of every family (GPU only)."""
import numpy as np
import pytest

from common.model_format import ModelDir
from common.models import FAMILIES
from expert_service.tiny_model import make_tiny
from expert_service.config import EngineConfig
from expert_service.engine import Engine, PrefillInput
from expert_service.sampling import SamplingParams
from tests.helpers import rel_error

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    model = make_tiny(tmp_path_factory.mktemp(request.param) / "m", family=request.param, seed=3)
    cfg = dict(kv_block_size=8, kv_cache_tokens=4096, max_batch_tokens=512, max_batch_size=16)
    return (request.param, Engine(ModelDir.open(model), EngineConfig(backend="cpu", **cfg)),
            Engine(ModelDir.open(model), EngineConfig(backend="cuda", **cfg)), model)


def prompt(seed, n, vocab=259):
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def test_prefill_logits_match_cpu_fp32(pair):
    name, cpu, gpu, _ = pair
    for n in (1, 33, 100):       # 100 > 64 tokens takes the cuBLAS path
        ids = prompt(n, n)
        err = rel_error(gpu.prompt_logits(ids), cpu.prompt_logits(ids))
        assert err <= 1e-4, f"{name}: prefill {n}: {err:.2e}"


def test_greedy_and_batched_decode_match_cpu(pair):
    name, cpu, gpu, _ = pair
    prompts = [prompt(10 + i, n) for i, n in enumerate((1, 5, 13, 70))]
    for p in prompts:
        assert gpu.generate(p, 12)[0] == cpu.generate(p, 12)[0], name
    outs = {}
    for engine in (cpu, gpu):
        first = engine.step([PrefillInput(100 + i, np.array(p), SamplingParams(), True) for i, p in enumerate(prompts)])
        tokens, rows = [[o.token_id] for o in first.outputs], [[r] for r in first.logits]
        for _ in range(6):
            step = engine.step(decode_ids=[100 + i for i in range(len(prompts))])
            for i, o in enumerate(step.outputs):
                tokens[i].append(o.token_id)
                rows[i].append(step.logits[i])
        engine.clear()
        outs[engine.backend] = (tokens, rows)
    assert outs["cuda"][0] == outs["cpu"][0], name
    for a, b in zip(outs["cuda"][1], outs["cpu"][1]):
        assert rel_error(np.stack(a), np.stack(b)) <= 1e-4, name


def test_graph_replay_equals_eager(pair):
    name, _, gpu, model = pair
    eager = Engine(ModelDir.open(model), EngineConfig(backend="cuda", cuda_graphs=False, kv_block_size=8,
                                                      kv_cache_tokens=4096, max_batch_tokens=512, max_batch_size=16))
    for engine in (gpu, eager):
        engine.step([PrefillInput(i, np.array(prompt(i, 3 + i)), SamplingParams(), True) for i in range(3)])
    results = []
    for engine in (gpu, eager):
        seq = []
        for _ in range(5):                   # several replays of the 4-bucket graph (3 real + 1 padded)
            step = engine.step(decode_ids=[0, 1, 2])
            seq.append((tuple(o.token_id for o in step.outputs), np.stack(list(step.logits))))
        engine.clear()
        results.append(seq)
    assert 4 in gpu.decoder.graphs, "decode steps did not use a CUDA graph"
    for (ta, la), (tb, lb) in zip(*results):
        assert ta == tb and np.array_equal(la, lb), name


def test_no_device_allocations_during_steps(pair, monkeypatch):
    from numba.cuda.cudadrv import driver
    name, _, gpu, _ = pair
    gpu.warmup()                        # what the worker does at start-up: compile, capture every bucket
    gpu.step([PrefillInput(5, np.array(prompt(5, 9)), SamplingParams(), True)])
    from cuda.bindings import driver as drv
    free_before = drv.cuMemGetInfo()[1]
    calls = []
    original = driver.Context.memalloc
    monkeypatch.setattr(driver.Context, "memalloc", lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    gpu.step([PrefillInput(6, np.array(prompt(6, 80)), SamplingParams(), True)], decode_ids=[5])
    for _ in range(4):
        gpu.step(decode_ids=[5, 6])
    gpu.clear()
    assert calls == [], f"{name}: {len(calls)} device allocations during steps"
    assert drv.cuMemGetInfo()[1] == free_before, f"{name}: device memory changed during steps (cuBLAS?)"


def test_bf16_weights_close_to_fp32_cpu(pair, tmp_path):
    from expert_service.convert import convert
    name, cpu, _, model = pair
    bf16 = convert(model / "hf", tmp_path / "bf16", dtype="bfloat16", progress=False)
    gpu16 = Engine(ModelDir.open(bf16), EngineConfig(backend="cuda", kv_block_size=8, kv_cache_tokens=4096,
                                                     max_batch_tokens=512, max_batch_size=16))
    cpu16 = Engine(ModelDir.open(bf16), EngineConfig(backend="cpu", kv_block_size=8, kv_cache_tokens=4096))
    for n in (40, 90):        # the fp32 CPU path on the same bf16 weights is the reference
        ids = prompt(7 + n, n)
        logits = gpu16.prompt_logits(ids)
        assert np.all(np.isfinite(logits))
        assert rel_error(logits, cpu16.prompt_logits(ids)) <= 1e-2, name
