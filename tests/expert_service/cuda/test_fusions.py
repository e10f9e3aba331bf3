"""The cuda backend's fused decoder paths and routing=lut (GPU only).

- Fusions (`rope_kv_write`, `qk_norm_rope_kv_write`, `moe_combine_rmsnorm`): with the options on, each launches
  where expected (counted on eager steps) and every logit equals the unfused path's bit for bit, eager and
  graph-replayed, on every family (fp32 tiny models: GEMV, grouped, all-experts and per-expert cuBLAS MoE
  strategies) and on bf16 models with 40+ experts (GROUPED_MMA).
- routing=lut: the same steps as the cpu backend's lut path, fed the same random plans: logits within the
  fp32 tolerance (bf16: 1e-2), the same greedy tokens, the plan's experts in the trace, graph replay == eager,
  nothing allocated after warm-up; with the exact routing as its plan, lut equals exact routing (mixtral); and
  through both services (router-gen table, router, worker) a token-routed model gives the cpu's exact tokens.
"""

import asyncio

import numpy as np
import pytest

from common.model_format import ModelDir
from common.models import FAMILIES
from common.routing_plan import RoutingPlan
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.cuda_options import CudaOptions
from expert_service.engine.engine import PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.tools.tiny_model import make_tiny
from tests.helpers import bf16_tiny, exact_plans, random_prompt, rel_error, run_session
from tests.spy import Spy

pytestmark = pytest.mark.gpu

CFG = dict(kv_block_size=8, kv_cache_tokens=4096, max_batch_tokens=512, max_batch_size=16)
PROMPT_LENS = (1, 13, 70)  # ragged, 84 tokens in one step: above 64, the cuBLAS / per-expert MoE paths
DECODES = 4  # steps of 3 sequences: graph bucket 4 with one padding slot
# bf16, GROUPED_MMA at every T >= 2; head_dim 64: the per-head q/k norms fused into qk_norm_rope_kv_write
MANY = {"qwen3_moe": dict(num_experts=40, num_experts_per_tok=8, head_dim=64)}
FP32_TOLERANCE, BF16_TOLERANCE = 1e-4, 1e-2


def random_plans(engine, seed):
    """A random routing plan (distinct experts per token) for each step of run_steps."""
    mc = engine.model_config
    rng = np.random.default_rng(seed)
    layers, E, K = mc.moe_layers, mc.num_experts, mc.num_experts_per_tok
    sizes = [sum(PROMPT_LENS)] + [len(PROMPT_LENS)] * DECODES
    return [
        RoutingPlan.from_expert_ids(
            layers, np.stack([[rng.choice(E, K, replace=False) for _ in range(T)] for _ in layers]).astype(np.uint16), E
        )
        for T in sizes
    ]


def run_steps(engine, plans=None):
    """The ragged prompts prefilled in one step, then DECODES decode steps of all of them: per step (tokens,
    logits [R, V] read before the next step overwrites them, trace)."""
    rids = list(range(len(PROMPT_LENS)))
    prefill = [
        PrefillInput(r, np.array(random_prompt(40 + r, n)), SamplingParams(), True) for r, n in zip(rids, PROMPT_LENS)
    ]
    steps = []
    for n in range(DECODES + 1):
        kw = dict(routing_plan=plans[n]) if plans else {}
        result = engine.step(prefill, **kw) if n == 0 else engine.step(decode_ids=rids, **kw)
        steps.append(([o.token_id for o in result.outputs], np.stack(list(result.logits)), result.trace))
    engine.clear()
    return steps


def assert_bitwise(a, b, what):
    for i, ((ta, la, _), (tb, lb, _)) in enumerate(zip(a, b)):
        assert ta == tb and np.array_equal(la, lb), f"{what}: step {i}: max diff {np.max(np.abs(la - lb)):.3g}"


@pytest.fixture(scope="module", params=sorted(FAMILIES) + ["qwen3_moe-many-bf16"])
def model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param.endswith("-many-bf16"):
        family = request.param.split("-")[0]
        return request.param, bf16_tiny(root, family, 5, **MANY[family])
    return request.param, make_tiny(root / "m", family=request.param, seed=3)


def open_engine(path, **overrides):
    return build_engine(ModelDir.open(path), EngineConfig(**{**CFG, "backend": "cuda", **overrides}))


# --- fusions -----------------------------------------------------------------------------------------------
def test_fusions_launch_and_equal_the_unfused_path_bit_for_bit(model, monkeypatch):
    import expert_service.cuda.model as cuda_model
    import expert_service.cuda.moe as moe

    name, path = model
    monkeypatch.setattr(moe, "FUSED_COMBINE_NORM_MIN_TOKENS", 1)  # fuse at every step size (default: large)
    eager, graphs = open_engine(path, cuda_graphs=False), open_engine(path)
    mc = eager.model_config
    rope_kv = Spy(monkeypatch, cuda_model, "launch_rope_kv_write")
    qk_norm_rope_kv = Spy(monkeypatch, cuda_model, "launch_qk_norm_rope_kv_write")
    combine_norm = Spy(monkeypatch, moe, "launch_moe_combine_rmsnorm")
    fused = run_steps(eager)
    passes = DECODES + 1
    fused_qk = name == "qwen3_moe-many-bf16"  # per-head norms at a head size the fused kernel takes
    assert eager.decoder.model.fused_qk_norm == fused_qk, name
    assert (qk_norm_rope_kv.calls, rope_kv.calls) == (
        (passes * mc.num_hidden_layers, 0) if fused_qk else (0, passes * mc.num_hidden_layers)
    ), name
    # the combine of every MoE layer but the last computes the next layer's input norm (not with a shared expert)
    fusable = 0 if mc.shared_expert_intermediate_size else sum(1 for i in mc.moe_layers if i + 1 < mc.num_hidden_layers)
    assert combine_norm.calls == passes * fusable, name
    replayed = run_steps(graphs)
    assert 4 in graphs.decoder.graphs, f"{name}: decode steps did not replay a graph"
    assert_bitwise(replayed, fused, f"{name}: graph replay vs eager, fusions on")

    unfused_options = CudaOptions(fused_rope_kv=False, fused_combine_norm=False, fused_qk_norm=False)
    eager.decoder.set_options(unfused_options)
    rope_kv.calls = combine_norm.calls = qk_norm_rope_kv.calls = 0
    unfused = run_steps(eager)
    assert rope_kv.calls == combine_norm.calls == qk_norm_rope_kv.calls == 0, name
    assert_bitwise(fused, unfused, f"{name}: fused vs unfused")
    graphs.decoder.set_options(unfused_options)  # graphs dropped, re-captured with the fusions off: same bits
    assert_bitwise(run_steps(graphs), unfused, f"{name}: re-captured graphs, fusions off")


def test_one_token_steps_take_one_gemv_over_the_stacked_qkv_rows(model, monkeypatch):
    """Where the format stored q, k, v back to back (and their biases, if any), a one-token step runs one GEMV
    for the three projections: two launches a layer fewer, the same tokens, logits within float32 rounding of the
    three GEMVs' (a longer matrix may split its rows' sums differently)."""
    import expert_service.cuda.linear as linear

    name, path = model
    engine = open_engine(path, cuda_graphs=False)
    w, layers = engine.decoder.weights, engine.model_config.num_hidden_layers
    stacked = w.layer(0, "qkv_proj") is not None and (
        w.layer(0, "q_bias") is None or w.layer(0, "qkv_bias") is not None
    )
    gemv = Spy(monkeypatch, linear, "launch_gemv")

    def decode(steps=3):
        engine.step([PrefillInput(1, np.array(random_prompt(7, 5)), SamplingParams(), True)])
        tokens, rows = [], []
        for _ in range(steps):
            result = engine.step(decode_ids=[1])
            tokens.append(result.outputs[0].token_id)
            rows.append(result.logits[0].copy())
        engine.clear()
        return tokens, np.stack(rows)

    fused = decode()
    fused_calls, gemv.calls = gemv.calls, 0
    engine.decoder.set_options(CudaOptions(fused_qkv=False))
    split = decode()
    assert gemv.calls - fused_calls == (2 * 3 * layers if stacked else 0), name
    assert stacked or name.startswith("qwen2_moe"), f"{name}: q, k, v not stacked"
    assert fused[0] == split[0], name
    assert rel_error(fused[1], split[1]) <= (BF16_TOLERANCE if "bf16" in name else FP32_TOLERANCE), name
    engine.close()


# --- routing=lut -------------------------------------------------------------------------------------------
def test_lut_matches_the_cpu_lut_path(model, monkeypatch):
    from expert_service.cuda import staging

    name, path = model
    gpu, eager = open_engine(path, routing="lut"), open_engine(path, routing="lut", cuda_graphs=False)
    cpu = build_engine(ModelDir.open(path), EngineConfig(**{**CFG, "backend": "cpu", "routing": "lut"}))
    plans = random_plans(gpu, seed=len(name))
    runs = [run_steps(gpu, plans)]
    monkeypatch.setattr(staging, "PLAN_COPY_GAP", 0)  # the eager engine stages its plans in a second copy
    runs += [run_steps(eager, plans), run_steps(cpu, plans)]
    assert_bitwise(runs[0], runs[1], f"{name}: lut graph replay (one copy) vs eager (two copies)")
    bf16 = name.endswith("bf16")
    E, mc = gpu.model_config.num_experts, gpu.model_config
    for i, ((tg, lg, trace), (tc, lc, _), plan) in enumerate(zip(runs[0], runs[2], plans)):
        want = plan.expert_ids(E, len(trace.expert_ids[mc.moe_layers[0]]), mc.num_experts_per_tok)
        for layer in mc.moe_layers:  # the trace reports the plan's experts: they are the routing
            np.testing.assert_array_equal(trace.expert_ids[layer], want[layer])
        err = rel_error(lg, lc)
        assert err <= (BF16_TOLERANCE if bf16 else FP32_TOLERANCE), f"{name}: lut step {i}: {err:.2e}"
        if tg != tc:  # bf16 may break a near-tie of the top logits differently; later inputs then differ
            assert bf16, f"{name}: lut step {i}: greedy tokens differ"
            break


def test_lut_refuses_a_step_without_a_plan_and_allocates_nothing_after_warmup(model, monkeypatch):
    from cuda.bindings import driver as drv
    from numba.cuda.cudadrv import driver

    from common.errors import InvalidRequestError

    name, path = model
    gpu = open_engine(path, routing="lut")
    with pytest.raises(InvalidRequestError, match="routing_plan"):
        gpu.step([PrefillInput(1, np.array(random_prompt(1, 5)), SamplingParams(), True)])
    assert not gpu.sequences, "a refused step must start no sequence"
    gpu.warmup()  # the worker's start-up: eager passes, then every bucket's graph
    plans = random_plans(gpu, seed=7)
    run_steps(gpu, plans)
    free_before = drv.cuMemGetInfo()[1]
    calls = []
    original = driver.Context.memalloc
    monkeypatch.setattr(driver.Context, "memalloc", lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    run_steps(gpu, plans)
    assert calls == [], f"{name}: {len(calls)} device allocations during lut steps"
    assert drv.cuMemGetInfo()[1] == free_before, f"{name}: device memory changed during lut steps"


def test_lut_with_the_exact_routing_as_plan_equals_exact_routing(tmp_path):
    """Mixtral's combine weights are the renormalised top-k, which is what lut computes for the planned experts:
    fed each step's exact routing (from a cpu run), the cuda lut path gives the cpu exact logits and tokens."""
    path = make_tiny(tmp_path / "m", family="mixtral", seed=4)
    model = ModelDir.open(path)
    logits, tokens, _, traces, _ = run_session(model, backend="cpu")
    lut_logits, lut_tokens, _, lut_traces, _ = run_session(model, exact_plans(traces), backend="cuda", routing="lut")
    assert lut_tokens == tokens
    for step, (a, b) in enumerate(zip(lut_logits, logits)):
        assert rel_error(a, b) <= FP32_TOLERANCE, f"step {step}: {rel_error(a, b):.2e}"
    for got, want in zip(lut_traces, traces):
        for layer, ids in want.expert_ids.items():
            np.testing.assert_array_equal(np.sort(got.expert_ids[layer], axis=1), np.sort(ids, axis=1))


def test_lut_through_router_and_worker_gives_exact_tokens_on_a_token_routed_model(tmp_path):
    """Both services with the table `colibri router-gen` builds without a corpus (the embedding fallback: recall
    1.0 on a token-routed model): the cuda worker under routing=lut streams the cpu engine's exact tokens."""
    from colibri.cli import main as colibri
    from common.pb import router_pb2 as rpb
    from tests.helpers import BackgroundWorker, make_token_routed_model, running_router

    model = make_token_routed_model(tmp_path)
    table = tmp_path / "table.bin"
    assert colibri(["router-gen", str(model), "--out", str(table)]) == 0
    prompts = [[5, 17, 42, 99, 3, 250, 7], [1, 2], list(range(10, 40))]
    cpu = build_engine(ModelDir.open(model), EngineConfig(backend="cpu"))
    expected = [cpu.generate(p, 10)[0] for p in prompts]
    worker = BackgroundWorker(model, backend="cuda", routing="lut").start()

    async def body():
        async with running_router(worker.address, max_batch_tokens=24, model=str(model), routing_table=str(table)) as (
            _,
            stub,
        ):
            requests = [
                rpb.GenerateRequest(
                    token_ids=rpb.TokenIds(ids=p), parameters=rpb.SamplingParameters(max_new_tokens=10, ignore_eos=True)
                )
                for p in prompts
            ]
            return await asyncio.gather(*(stub.Generate(r) for r in requests))

    try:
        replies = asyncio.run(body())
    finally:
        worker.stop()
    assert [list(r.token_ids) for r in replies] == expected
    assert all(r.routing == "lut" for r in replies)
