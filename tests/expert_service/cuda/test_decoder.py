"""The cuda backend against the fp32 CPU reference on tiny models of every family (GPU only)."""

import numpy as np
import pytest

from common.model_format import ModelDir
from common.models import FAMILIES
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.tools.tiny_model import make_tiny
from tests.helpers import bf16_tiny, random_prompt, rel_error

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    model = make_tiny(tmp_path_factory.mktemp(request.param) / "m", family=request.param, seed=3)
    cfg = dict(kv_block_size=8, kv_cache_tokens=4096, max_batch_tokens=512, max_batch_size=16)
    return (
        request.param,
        build_engine(ModelDir.open(model), EngineConfig(backend="cpu", **cfg)),
        build_engine(ModelDir.open(model), EngineConfig(backend="cuda", **cfg)),
        model,
    )


def test_prefill_logits_match_cpu_fp32(pair):
    name, cpu, gpu, _ = pair
    for n in (1, 33, 100):  # 100 > 64 tokens takes the cuBLAS path
        ids = random_prompt(n, n)
        err = rel_error(gpu.prompt_logits(ids), cpu.prompt_logits(ids))
        assert err <= 1e-4, f"{name}: prefill {n}: {err:.2e}"


def test_greedy_and_batched_decode_match_cpu(pair):
    name, cpu, gpu, _ = pair
    prompts = [random_prompt(10 + i, n) for i, n in enumerate((1, 5, 13, 70))]
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
    eager = build_engine(
        ModelDir.open(model),
        EngineConfig(
            backend="cuda",
            cuda_graphs=False,
            kv_block_size=8,
            kv_cache_tokens=4096,
            max_batch_tokens=512,
            max_batch_size=16,
        ),
    )
    for engine in (gpu, eager):
        engine.step([PrefillInput(i, np.array(random_prompt(i, 3 + i)), SamplingParams(), True) for i in range(3)])
    results = []
    for engine in (gpu, eager):
        seq = []
        for _ in range(5):  # several replays of the 4-bucket graph (3 real + 1 padded)
            step = engine.step(decode_ids=[0, 1, 2])
            seq.append((tuple(o.token_id for o in step.outputs), np.stack(list(step.logits))))
        engine.clear()
        results.append(seq)
    assert 4 in gpu.decoder.graphs, "decode steps did not use a CUDA graph"
    for (ta, la), (tb, lb) in zip(*results):
        assert ta == tb and np.array_equal(la, lb), name


def test_step_logits_read_after_the_next_step_raise(pair):
    """A step's rows live in the workspace the next step overwrites: read in time they stay that step's; read
    later they raise instead of returning the later step's rows."""
    name, _, gpu, _ = pair
    first = gpu.step([PrefillInput(0, np.array(random_prompt(0, 6)), SamplingParams(), True)])
    rows = np.stack(list(first.logits))
    second = gpu.step(decode_ids=[0])
    third = gpu.step(decode_ids=[0])
    gpu.clear()
    with pytest.raises(RuntimeError, match="read after step"):
        second.logits[0]
    assert np.array_equal(np.stack(list(first.logits)), rows), name
    assert not np.array_equal(third.logits[0], rows[0]) and third.logits.greedy(0)[0] == third.outputs[0].token_id


def test_no_device_allocations_during_steps(pair, monkeypatch):
    from numba.cuda.cudadrv import driver

    name, _, gpu, _ = pair
    gpu.warmup()  # what the worker does at start-up: compile, capture every bucket
    gpu.step([PrefillInput(5, np.array(random_prompt(5, 9)), SamplingParams(), True)])
    from cuda.bindings import driver as drv

    free_before = drv.cuMemGetInfo()[1]
    calls = []
    original = driver.Context.memalloc
    monkeypatch.setattr(driver.Context, "memalloc", lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    gpu.step([PrefillInput(6, np.array(random_prompt(6, 80)), SamplingParams(), True)], decode_ids=[5])
    for _ in range(4):
        gpu.step(decode_ids=[5, 6])
    gpu.clear()
    assert calls == [], f"{name}: {len(calls)} device allocations during steps"
    assert drv.cuMemGetInfo()[1] == free_before, f"{name}: device memory changed during steps (cuBLAS?)"


def test_bf16_weights_close_to_fp32_cpu(pair, tmp_path):
    from expert_service.tools.convert import convert

    name, cpu, _, model = pair
    bf16 = convert(model / "hf", tmp_path / "bf16", dtype="bfloat16", progress=False)
    gpu16 = build_engine(
        ModelDir.open(bf16),
        EngineConfig(backend="cuda", kv_block_size=8, kv_cache_tokens=4096, max_batch_tokens=512, max_batch_size=16),
    )
    cpu16 = build_engine(ModelDir.open(bf16), EngineConfig(backend="cpu", kv_block_size=8, kv_cache_tokens=4096))
    for n in (40, 90):  # the fp32 CPU path on the same bf16 weights is the reference
        ids = random_prompt(7 + n, n)
        logits = gpu16.prompt_logits(ids)
        assert np.all(np.isfinite(logits))
        assert rel_error(logits, cpu16.prompt_logits(ids)) <= 1e-2, name


# --- many experts: GROUPED_MMA (the grouped tensor-core MoE GEMM), gate_fused, greedy_split ---------------
# E >= GROUPED_MMA_MIN_EXPERTS bf16 experts: every MoE step of >= 2 tokens takes GROUPED_MMA. qwen3_moe: two
# MoE layers, F = 96 (16-byte loads); qwen2_moe: one MoE layer, a shared expert, F = 36 (element loads). With
# K = 8 the prefills below reach each GPU tile config: 2 and 33 tokens 16-row tiles, 150 tokens 32, 300 tokens
# 64 (choose_config); up to 64 tokens route with gate_fused, above with cuBLAS + gate_topk.
MANY_EXPERTS = {
    "qwen3_moe": dict(num_experts=40, num_experts_per_tok=8),
    "qwen2_moe": dict(num_experts=48, num_experts_per_tok=8, moe_intermediate_size=36),
}
MANY_CFG = dict(kv_block_size=8, kv_cache_tokens=4096, max_batch_tokens=512, max_batch_size=16)
BF16_TOLERANCE = 1e-2  # as test_bf16_weights_close_to_fp32_cpu
ROUTER_TIE = 0.05  # router logits within this of the CPU's K-th are a tie bf16 may break either way


@pytest.fixture(scope="module", params=sorted(MANY_EXPERTS))
def many(request, tmp_path_factory):
    model = bf16_tiny(tmp_path_factory.mktemp(request.param + "_many"), request.param, 5, **MANY_EXPERTS[request.param])
    open_ = lambda **kw: build_engine(ModelDir.open(model), EngineConfig(**{**MANY_CFG, **kw}))  # noqa: E731
    return (request.param, open_(backend="cpu"), open_(backend="cuda"), open_(backend="cuda", cuda_graphs=False))


class ForcedRouting:
    """The fp32 CPU reference routes with the GPU's expert ids (queued per MoE layer call) and weights from its
    own router probabilities. With 40+ experts a prefill has tokens whose K-th and (K+1)-th router logits lie
    within bf16 noise (about 1e-2 here), which the bf16 GPU and the fp32 CPU break differently; such a token's
    output then differs far beyond any tolerance (3-8e-2 at 33-250 tokens, in the simulator). Forcing the routing
    compares the arithmetic; `worst_tie` checks that the GPU only departs from the CPU's top-k at such ties."""

    def __init__(self, monkeypatch):
        import expert_service.cpu.layers.moe as cpu_moe

        self.queue, self.worst_tie = [], 0.0
        monkeypatch.setattr(cpu_moe, "route", self.route)

    def route(self, logits, top_k, normalize):
        ids = self.queue.pop(0).astype(np.int64)
        lg = logits.astype(np.float32)
        assert ids.shape == (lg.shape[0], top_k) and (np.sort(ids, axis=1)[:, 1:] != np.sort(ids, axis=1)[:, :-1]).all()
        kth = -np.sort(-lg, axis=1)[:, top_k - 1]
        self.worst_tie = max(self.worst_tie, float((kth - np.take_along_axis(lg, ids, axis=1).min(axis=1)).max()))
        probs = np.exp(lg - lg.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        weights = np.take_along_axis(probs, ids, axis=1)
        if normalize:
            weights = weights / weights.sum(axis=1, keepdims=True)
        return ids, weights.astype(np.float32)

    def assert_only_ties(self, name: str) -> None:
        """The GPU left the CPU's own top-k only where its logits were within ROUTER_TIE of the K-th."""
        assert self.worst_tie <= ROUTER_TIE, f"{name}: GPU routing departs from the CPU's top-k by {self.worst_tie}"


def replay_on_cpu(cpu, forced: ForcedRouting, runs, prefill, rids, moe_layers, name: str) -> None:
    """The CPU reference runs a GPU's steps `runs` [(tokens, logits [R, V], trace)] again, fed their routing (the
    trace's expert ids) and, after `prefill`, the GPU's tokens: each step's logits within BF16_TOLERANCE, the GPU's
    greedy tokens the CPU's argmax up to it; the CPU is cleared after."""
    inputs = prefill
    for i, (tokens, logits, trace) in enumerate(runs):
        forced.queue = [trace.expert_ids[layer] for layer in moe_layers]
        ref = cpu.step(inputs)
        assert not forced.queue
        ref_rows = np.stack(list(ref.logits))
        err = rel_error(logits, ref_rows)
        assert err <= BF16_TOLERANCE, f"{name} step {i}: {err:.2e}"
        assert_greedy_close(tokens, ref_rows, f"{name} step {i}")
        inputs = [PrefillInput(r, np.array([t]), None, True) for r, t in zip(rids, tokens)]  # GPU's tokens
    cpu.clear()


def last_step_expert_ids(engine, T):
    """[MoE layers] of [T, K]: the top-k ids the GPU's last forward left in its workspace (layer-major, each
    layer's block as long as the token bucket the step was padded to)."""
    d = engine.decoder
    K = engine.model_config.num_experts_per_tok
    padded = d._prefill_bucket(T) or T
    flat = d.ws.topk_ids.copy_to_host().reshape(-1)[: len(d.moe_layers) * padded * K]
    return [layer[:T] for layer in flat.reshape(len(d.moe_layers), padded, K)]


def assert_greedy_close(tokens, cpu_rows, name):
    """The GPU's greedy tokens are the CPU's argmax up to the bf16 tolerance: equal wherever the CPU's best
    logit leads the next by more than that."""
    rows = np.asarray(cpu_rows)
    chosen = rows[np.arange(len(rows)), np.asarray(tokens)]
    assert np.all(rows.max(axis=1) - chosen <= BF16_TOLERANCE * np.abs(rows).max()), name


def test_many_experts_prefill_close_to_cpu(many, monkeypatch):
    from expert_service.cuda.moe_strategy import MoeStrategy, choose_strategy
    from expert_service.kernels.moe_gemm_mma import choose_config

    name, cpu, gpu, _ = many
    mc = gpu.model_config
    K, E = mc.num_experts_per_tok, mc.num_experts
    sizes = (2, 33, 150, 400)
    assert all(choose_strategy(n, K, E, cached=False, bf16=True) is MoeStrategy.GROUPED_MMA for n in sizes)
    assert {choose_config(n * K, E).block_m for n in sizes} == {16, 32, 64}
    assert "mma_xs" in gpu.decoder.ws.arrays and "moe_in" not in gpu.decoder.ws.arrays
    forced = ForcedRouting(monkeypatch)
    for n in sizes:
        ids = random_prompt(400 + n, n)
        logits = gpu.prompt_logits(ids)
        assert np.all(np.isfinite(logits)), f"{name}: prefill {n}"
        forced.queue = last_step_expert_ids(gpu, n)
        ref = cpu.prompt_logits(ids)
        assert not forced.queue
        err = rel_error(logits, ref)
        assert err <= BF16_TOLERANCE, f"{name}: prefill {n}: {err:.2e}"
        assert_greedy_close(logits.argmax(axis=1), ref, f"{name}: prefill {n}")
    forced.assert_only_ties(name)


def test_many_experts_batched_decode(many, monkeypatch):
    """Decode at batch sizes 1, 2, 5 and 12 (graph buckets 1, 2, 8, 16; GEMV at one token, GROUPED_MMA above):
    replays equal eager steps bit for bit, and each step's logits match the CPU reference fed the same tokens
    and routing."""
    name, cpu, gpu, eager = many
    forced = ForcedRouting(monkeypatch)
    moe_layers = gpu.decoder.moe_layers
    for batch in (1, 2, 5, 12):
        prompts = [random_prompt(500 + 13 * batch + i, 2 + i % 4) for i in range(batch)]
        rids = list(range(batch))
        prefill = [PrefillInput(r, np.array(p), SamplingParams(), True) for r, p in zip(rids, prompts)]
        runs = {}
        for engine in (gpu, eager):
            runs[engine] = []
            for n in range(5):  # each step's rows read before the next step overwrites the device logits
                s = engine.step(prefill) if n == 0 else engine.step(decode_ids=rids)
                runs[engine].append(([o.token_id for o in s.outputs], np.stack(list(s.logits)), s.trace))
            engine.clear()
        for (ta, la, _), (tb, lb, _) in zip(runs[gpu], runs[eager]):
            assert ta == tb and np.array_equal(la, lb), f"{name}: batch {batch}: graph replay != eager"
        replay_on_cpu(cpu, forced, runs[gpu], prefill, rids, moe_layers, f"{name}: batch {batch}")
    assert {1, 2, 8, 16} <= set(gpu.decoder.graphs), f"{name}: decode steps did not use CUDA graphs"
    forced.assert_only_ties(name)


def test_many_experts_no_device_allocations(many, monkeypatch):
    """After warm-up (which takes every tile config and router a step of up to 512 tokens can), prefills at
    each tile config and graph-replayed decode steps allocate nothing on the device."""
    from cuda.bindings import driver as drv
    from numba.cuda.cudadrv import driver

    name, _, gpu, _ = many
    gpu.warmup()
    gpu.step([PrefillInput(5, np.array(random_prompt(5, 9)), SamplingParams(), True)])
    free_before = drv.cuMemGetInfo()[1]
    calls = []
    original = driver.Context.memalloc
    monkeypatch.setattr(driver.Context, "memalloc", lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    for rid, n in ((6, 33), (7, 150), (8, 300)):
        gpu.step([PrefillInput(rid, np.array(random_prompt(rid, n)), SamplingParams(), True)], decode_ids=[5])
    for _ in range(4):
        gpu.step(decode_ids=[5, 6, 7, 8])
    gpu.clear()
    assert calls == [], f"{name}: {len(calls)} device allocations during steps"
    assert drv.cuMemGetInfo()[1] == free_before, f"{name}: device memory changed during steps"


def _decode_runs(engine, prompts, options_list, steps=4):
    """Per CudaOptions (set_options drops the graphs of the ones before): the prompts prefilled, then `steps` decode
    steps of them all, as [(token ids, logits [S, V])] a step."""
    rids = list(range(len(prompts)))
    runs = []
    for options in options_list:
        engine.decoder.set_options(options)
        engine.step([PrefillInput(r, np.array(p), SamplingParams(), True) for r, p in zip(rids, prompts)])
        run = []
        for _ in range(steps):
            s = engine.step(decode_ids=rids)
            run.append(([o.token_id for o in s.outputs], np.stack(list(s.logits))))
        engine.clear()
        runs.append(run)
    return runs


def test_tiled_decode_attention_matches_attention_decode(tmp_path):
    """CudaOptions.tiled_decode_attention: the same tokens and logits (fp32 attention either way, summed in
    another order) on a bf16 model with Hd = 64 and a GQA group of 8, contexts crossing several 32-key tiles."""
    from expert_service.engine.cuda_options import CudaOptions
    from expert_service.kernels.attention_decode_tiled import supports

    model = bf16_tiny(tmp_path, "qwen3_moe", 9, head_dim=64, num_attention_heads=8, num_key_value_heads=1)
    engine = build_engine(ModelDir.open(model), EngineConfig(backend="cuda", **MANY_CFG))
    assert supports(engine.decoder.k_pool[0].dtype, 64, MANY_CFG["kv_block_size"])
    prompts = [random_prompt(900 + i, n) for i, n in enumerate((70, 5, 33))]
    # mma_decode_attention off, or neither run would use the kernels compared
    runs = _decode_runs(
        engine, prompts, [CudaOptions(tiled_decode_attention=t, mma_decode_attention=False) for t in (False, True)]
    )
    for i, ((ta, la), (tb, lb)) in enumerate(zip(*runs)):
        assert ta == tb and rel_error(lb, la) <= 1e-4, f"decode step {i}: {rel_error(lb, la):.2e}"
    engine.decoder.close()


def test_mma_decode_attention_matches_the_tiled_kernel(tmp_path):
    """CudaOptions.mma_decode_attention: the same tokens, logits within the bf16 rounding of q and P (the kernel
    test's 1e-2 of the attention output), on a bf16 model with Hd = 64 and a GQA group of 8 (the mma's rows), one
    sequence past a split part of 64 keys, two within one."""
    from expert_service.engine.cuda_options import CudaOptions
    from expert_service.kernels.attention_decode_mma import supports

    model = bf16_tiny(tmp_path, "qwen3_moe", 10, head_dim=64, num_attention_heads=8, num_key_value_heads=1)
    engine = build_engine(ModelDir.open(model), EngineConfig(backend="cuda", **MANY_CFG))
    assert supports(engine.decoder.k_pool[0].dtype, 64, MANY_CFG["kv_block_size"], 8)
    prompts = [random_prompt(950 + i, n) for i, n in enumerate((90, 5, 33))]
    runs = _decode_runs(engine, prompts, [CudaOptions(mma_decode_attention=m) for m in (False, True)])
    for i, ((ta, la), (tb, lb)) in enumerate(zip(*runs)):
        assert ta == tb and rel_error(lb, la) <= 2e-2, f"decode step {i}: {rel_error(lb, la):.2e}"
    engine.decoder.close()


# --- the warpgroup-MMA grouped kernel (sm_90) ------------------------------------------------------------
# D = 64 and F = 128 (multiples of 64), 32 experts, K = 8: a 480-token prefill routes 120 rows per expert
# (above moe_grouped_mma.WGMMA_MIN_ROWS, so the w128 tile), 150 tokens 37 (moe_gemm_mma's tiles).
WGMMA_MODEL = dict(num_experts=32, num_experts_per_tok=8, moe_intermediate_size=128)


@pytest.fixture(scope="module")
def wgmma_model(tmp_path_factory):
    return bf16_tiny(tmp_path_factory.mktemp("qwen3_wgmma"), "qwen3_moe", 11, **WGMMA_MODEL)


def check_wgmma_prefills(model, monkeypatch, on, off, cases, seed: int, before_steps=None) -> None:
    """On an sm_90 device: prefills of each (tokens, wgmma) case on an engine with options `on` launch the wgmma
    grouped kernel exactly when wgmma says, and match the CPU backend routed the same way; then the first case's
    size again under `off` launches it no more and matches the CPU the same way. before_steps(engine): more checks."""
    import expert_service.cuda.moe_grouped_mma as grouped

    if not grouped.hopper():
        pytest.skip("wgmma needs an sm_90 device")
    launches = []
    original = grouped.launch_wgmma_gate_up
    monkeypatch.setattr(grouped, "launch_wgmma_gate_up", lambda *a, **k: (launches.append(1), original(*a, **k)))
    open_ = lambda **kw: build_engine(ModelDir.open(model), EngineConfig(**{**MANY_CFG, **kw}))  # noqa: E731
    cpu, gpu = open_(backend="cpu"), open_(backend="cuda", cuda_graphs=False, cuda_options=on)
    if before_steps is not None:
        before_steps(gpu)
    forced = ForcedRouting(monkeypatch)
    for n, wgmma in cases:
        ids = random_prompt(seed + n, n)
        before = len(launches)
        logits = gpu.prompt_logits(ids)
        assert (len(launches) > before) == wgmma, f"prefill {n}: wgmma launched {len(launches) - before} times"
        assert np.all(np.isfinite(logits)), f"prefill {n}"
        forced.queue = last_step_expert_ids(gpu, n)
        ref = cpu.prompt_logits(ids)
        err = rel_error(logits, ref)
        assert err <= BF16_TOLERANCE, f"prefill {n}: {err:.2e}"
        assert_greedy_close(logits.argmax(axis=1), ref, f"prefill {n}")
    # `off` against the CPU routed its own way: comparing it with `on` directly fails wherever the two bf16 paths
    # break a router near-tie differently (H200: 0.28 on a few-expert model at 480 tokens)
    n = cases[0][0]
    ids = random_prompt(seed + 1000 + n, n)
    gpu.decoder.set_options(off)
    before = len(launches)
    without = gpu.prompt_logits(ids)
    assert len(launches) == before, f"{off} still launched the wgmma kernel"
    forced.queue = last_step_expert_ids(gpu, n)
    assert rel_error(without, cpu.prompt_logits(ids)) <= BF16_TOLERANCE
    forced.assert_only_ties("wgmma prefill")
    gpu.decoder.close()


def test_wgmma_prefill_close_to_cpu_and_to_mma(wgmma_model, monkeypatch):
    from expert_service.engine.cuda_options import CudaOptions

    off = CudaOptions(wgmma_experts=False)
    check_wgmma_prefills(wgmma_model, monkeypatch, CudaOptions(), off, ((480, True), (150, False)), 900)


# Few experts (mixtral-like: E = 8, K = 2) with CudaOptions.grouped_mma_max_tokens_few_experts: a 480-token prefill
# (padded to its 512-token bucket: 128 rows an expert) runs GROUPED_MMA on the wgmma kernel with no host break; 250
# tokens (the 256 bucket: 64 rows) keep per-expert cuBLAS. D = 64, F = 128: dims the wgmma kernel takes.
FEW_MODEL = dict(num_local_experts=8, intermediate_size=128)


@pytest.fixture(scope="module")
def few_model(tmp_path_factory):
    return bf16_tiny(tmp_path_factory.mktemp("mixtral_few"), "mixtral", 13, **FEW_MODEL)


def test_few_expert_window_runs_wgmma_close_to_cpu_and_to_cublas(few_model, monkeypatch):
    from expert_service.engine.cuda_options import CudaOptions

    def host_breaks(gpu):  # the window's step is captured whole; the smaller one keeps its host break
        assert not gpu.decoder.blocks_host(480) and gpu.decoder.blocks_host(250)

    window, off = CudaOptions(), CudaOptions(grouped_mma_max_tokens_few_experts=0)  # the shipped window; cuBLAS
    check_wgmma_prefills(few_model, monkeypatch, window, off, ((480, True), (250, False)), 700, host_breaks)
