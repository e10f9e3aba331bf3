"""Non-decode steps padded to a token bucket and replayed from a CUDA graph of the layers (GPU only).

Every family's fp32 tiny model (buckets up to 64 tokens are capturable there; larger prefills take per-expert
cuBLAS and stay eager), a bf16 many-expert model (GROUPED_MMA at every size: every bucket is captured) and a bf16
few-expert one (mixtral-like: per-expert cuBLAS above 64 tokens, eager)."""
import numpy as np
import pytest

from common.model_format import ModelDir
from common.models import FAMILIES
from expert_service.config import EngineConfig
from expert_service.cuda.decoder import prefill_buckets
from expert_service.engine import Engine, PrefillInput
from expert_service.sampling import SamplingParams
from expert_service.tiny_model import make_tiny
from tests.helpers import bf16_tiny, random_prompt, rel_error

pytestmark = pytest.mark.gpu
CFG = dict(kv_block_size=8, kv_cache_tokens=4096, max_batch_tokens=512, max_batch_size=16)
MODELS = {**{family: None for family in sorted(FAMILIES)},
          "qwen3_moe_many_bf16": ("qwen3_moe", dict(num_experts=40, num_experts_per_tok=8)),
          "mixtral_bf16": ("mixtral", {})}


@pytest.fixture(scope="module", params=sorted(MODELS))
def engines(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    spec = MODELS[request.param]
    model = make_tiny(root / "m", family=request.param, seed=11) if spec is None else \
        bf16_tiny(root, spec[0], 11, **spec[1])
    open_ = lambda **kw: Engine(ModelDir.open(model), EngineConfig(**{**CFG, **kw}))    # noqa: E731
    tolerance = 1e-4 if spec is None else 2e-2
    return request.param, open_(backend="cpu"), open_(backend="cuda"), open_(backend="cuda", cuda_graphs=False), \
        tolerance


def bucket_of(T: int) -> int:
    return next(b for b in prefill_buckets(CFG["max_batch_tokens"]) if b >= T)


def test_buckets_replay_what_the_eager_pass_computed(engines):
    """Each prefill size runs three times (eager, captured, replayed): the same bits every time, the bucket's graph
    captured where the decoder says it is capturable, and the last row close to the CPU reference."""
    name, cpu, gpu, _, tolerance = engines
    d = gpu.decoder
    for n in (5, 33, 64, 100, 300):
        prompt = random_prompt(50 + n, n)
        runs = []
        for _ in range(3):
            step = gpu.step([PrefillInput(1, np.array(prompt), SamplingParams(), True)])
            runs.append((step.outputs[0].token_id, step.logits[0].copy()))
            gpu.clear()
        assert all(t == runs[0][0] and np.array_equal(row, runs[0][1]) for t, row in runs), f"{name}: prefill {n}"
        captured = d._prefill_capturable(bucket_of(n))
        assert (bucket_of(n) in d.prefill_graphs) == captured, f"{name}: prefill {n}"
        ref = cpu.step([PrefillInput(1, np.array(prompt), SamplingParams(), True)])
        cpu.clear()
        err = rel_error(runs[0][1], ref.logits[0])
        assert err <= tolerance, f"{name}: prefill {n}: {err:.2e}"
    if name == "qwen3_moe_many_bf16":
        assert {6, 48, 64, 128, 384} <= set(d.prefill_graphs), name
    if name == "mixtral_bf16":
        assert not {128, 384} & set(d.prefill_graphs), f"{name}: per-expert cuBLAS steps were captured"


def test_mixed_steps_match_eager_and_cpu(engines):
    """A prefill chunk beside decoding sequences (the continuous-batching step): the graph engine and the eager
    one compute the same bits (both pad to the bucket), close to the CPU; the padding's KV writes go nowhere, so
    the greedy continuations agree with the CPU's."""
    name, cpu, gpu, eager, tolerance = engines
    prompts = {1: random_prompt(7, 12), 2: random_prompt(8, 3), 3: random_prompt(9, 45)}
    outs = {}
    for engine in (gpu, eager, cpu):
        first = engine.step([PrefillInput(r, np.array(prompts[r]), SamplingParams(), True) for r in (1, 2)])
        tokens = {1: [first.outputs[0].token_id], 2: [first.outputs[1].token_id]}
        rows = [np.stack(list(first.logits))]
        mixed = engine.step([PrefillInput(3, np.array(prompts[3]), SamplingParams(), True)], decode_ids=[1, 2])
        for o in mixed.outputs:
            tokens.setdefault(o.request_id, []).append(o.token_id)
        rows.append(np.stack(list(mixed.logits)))
        for _ in range(4):
            step = engine.step(decode_ids=[1, 2, 3])
            for o in step.outputs:
                tokens[o.request_id].append(o.token_id)
            rows.append(np.stack(list(step.logits)))
        engine.clear()
        outs[engine] = (tokens, rows)
    for a, b in zip(outs[gpu][1], outs[eager][1]):
        assert np.array_equal(a, b), f"{name}: graph replay != eager"
    if tolerance <= 1e-4:      # fp32: the same greedy tokens as the CPU
        assert outs[gpu][0] == outs[cpu][0], name
    err = max(rel_error(a, b) for a, b in zip(outs[gpu][1][:2], outs[cpu][1][:2]))
    assert err <= tolerance, f"{name}: {err:.2e}"


def test_padding_writes_no_kv(engines):
    """A prefill padded from 33 to 48 tokens changes exactly its own 33 KV slots of every layer's pools."""
    name, _, gpu, _, _ = engines
    d = gpu.decoder
    before = d.k_pool.copy_to_host(), d.v_pool.copy_to_host()
    gpu.step([PrefillInput(4, np.array(random_prompt(4, 33)), SamplingParams(), True)])
    after = d.k_pool.copy_to_host(), d.v_pool.copy_to_host()
    table = gpu.allocator.tables[4]
    gpu.clear()
    own = np.zeros(before[0].shape[1:3], bool)         # [blocks, block_size]
    for t in range(33):
        own[table[t // d.block_size], t % d.block_size] = True
    for b, a in zip(before, after):
        changed = (b != a).any(axis=(0, 3, 4))          # over layers, heads, head dims
        assert not (changed & ~own).any(), f"{name}: the padding wrote KV"
        assert changed[own].all(), f"{name}: a real token's KV was not written"


def test_chunked_prompt_matches_the_whole_prompt(engines):
    """A prompt in three chunks (the first two sample nothing: steps without logits rows, padded and replayed like
    any other) ends with the logits the whole prompt gives, and the eager engine agrees bit for bit."""
    name, _, gpu, eager, tolerance = engines
    prompt = np.array(random_prompt(21, 70))
    rows = {}
    for engine in (gpu, eager):
        for _ in range(2):             # the second time the buckets replay their graphs
            parts = [engine.step([PrefillInput(9, prompt[a:b], SamplingParams() if a == 0 else None, b == 70)])
                     for a, b in ((0, 20), (20, 45), (45, 70))]
            assert [o.token_id for p in parts[:2] for o in p.outputs] == [None, None], name
            rows.setdefault(engine, []).append(parts[-1].logits[0].copy())
            engine.clear()
        whole = engine.step([PrefillInput(9, prompt, SamplingParams(), True)])
        rows[engine].append(whole.logits[0].copy())
        engine.clear()
    assert np.array_equal(rows[gpu][0], rows[gpu][1]) and np.array_equal(rows[gpu][0], rows[eager][0]), name
    err = rel_error(rows[gpu][0], rows[gpu][2])
    assert err <= tolerance, f"{name}: chunked vs whole prompt {err:.2e}"
    assert {24, 32} <= set(gpu.decoder.prefill_graphs), f"{name}: the chunks did not replay graphs"
