"""The cuda backend on 8-bit experts against the cpu backend on the same converted model (GPU only): int8,
fp8 with 128x128 block scales, fp8 per channel, and a mixed model (fp8, int8, bfloat16 and float32 experts in
one layer), and a model mixing only 8-bit experts (int8, fp8 with both scales: the grouped tensor-core kernel,
Q8_MMA, runs its steps of 2-64 tokens); greedy tokens equal, logits within the bf16 tolerance, graphs and eager,
no device allocations; Q8_MMA against moe_q8 / per-expert cuBLAS on the same model; W8A8 prefill and int8-activation
decode (q8_decode_activations) against the cpu backend running their roundings."""

import json

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.cuda_options import CudaOptions
from expert_service.engine.engine import PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.tools.convert import convert
from expert_service.tools.tiny_model import make_tiny
from tests.helpers import random_prompt, rel_error

pytestmark = pytest.mark.gpu

CFG = dict(kv_block_size=8, kv_cache_tokens=4096, max_batch_tokens=512, max_batch_size=16)
TOLERANCE = 1e-2  # as test_bf16_weights_close_to_fp32_cpu
# the float32 activations the exact cpu backend computes with (int8 ones are held to their own emulation below)
EXACT_ACTIVATIONS = CudaOptions(q8_decode_activations=False)
VARIANTS = ("int8", "fp8-block128", "fp8-channel", "mixed", "mixed-8bit")
FAMILIES = ("mixtral", "qwen3_moe")


def quantized_model(
    root, family: str, variant: str, dense: str | None = None, head: str | None = None, attention: str | None = None
):
    """The tiny model with 8-bit experts; `dense`: the other tensors' dtype (None: the checkpoint's float32);
    `head` / `attention`: the LM head's / attention projections' 8-bit dtype (None: the dense dtype)."""
    model = make_tiny(root / "f32", family=family, seed=11)
    if variant.startswith("mixed"):
        # first MoE layer fp8, the rest int8; the last layer: expert 1 bf16, 2 float32, 3 fp8 ("mixed") or
        # expert 1 fp8 with per-channel scales, 3 fp8 block128 ("mixed-8bit": every expert 8-bit)
        first, last = ModelDir.open(model).config.moe_layers[0], ModelDir.open(model).config.moe_layers[-1]
        plan = root / "mixed.json"
        others = {f"{last}.1": "bfloat16", f"{last}.2": "float32"} if variant == "mixed" else {}
        scale = "block128" if variant == "mixed" else "channel"
        plan.write_text(
            json.dumps(
                {
                    "default": "int8",
                    "fp8_scale": scale,
                    "layers": {str(first): "fp8"},
                    "experts": {**others, f"{last}.3": "fp8"},
                }
            )
        )
        return convert(
            model / "hf",
            root / variant,
            dense,
            progress=False,
            expert_dtype_file=plan,
            head_dtype=head,
            attention_dtype=attention,
        )
    dtype, _, scale = variant.partition("-")
    return convert(
        model / "hf",
        root / variant,
        dense,
        progress=False,
        expert_dtype=dtype,
        fp8_scale=scale or None,
        head_dtype=head,
        attention_dtype=attention,
    )


@pytest.fixture(scope="module", params=[(f, v) for f in FAMILIES for v in VARIANTS], ids=lambda p: "-".join(p))
def engines(request, tmp_path_factory):
    family, variant = request.param
    model = quantized_model(tmp_path_factory.mktemp(f"{family}-{variant}"), family, variant)
    open_ = lambda **kw: build_engine(ModelDir.open(model), EngineConfig(**{**CFG, **kw}))  # noqa: E731
    return (
        f"{family}/{variant}",
        open_(backend="cpu"),
        {
            "graphs": open_(backend="cuda", cuda_options=EXACT_ACTIVATIONS),
            "eager": open_(backend="cuda", cuda_options=EXACT_ACTIVATIONS, cuda_graphs=False),
        },
    )


def check_greedy_tokens(engines, lengths, seed: int) -> None:
    """Ten greedy tokens after random prompts of `lengths` tokens: every gpu's equal the cpu backend's."""
    name, cpu, gpus = engines
    for i, n in enumerate(lengths):
        prompt = random_prompt(seed + i, n)
        want = cpu.generate(prompt, 10)[0]
        for mode, gpu in gpus.items():
            assert gpu.generate(prompt, 10)[0] == want, f"{name} {mode} prompt of {n}"


def test_greedy_tokens_match_cpu(engines):
    check_greedy_tokens(engines, (1, 5, 13, 70, 130), seed=30)  # 1: by slot; up to 64 grouped; above per-expert cuBLAS


def test_batched_decode_logits_close_to_cpu(engines):
    prompts = [random_prompt(50 + i, n) for i, n in enumerate((3, 9, 40, 80))]  # 4 sequences: the grouped kernel
    check_batched_decode(engines, prompts, first_id=200, steps=5)


def test_prompt_logits_close_to_cpu(engines):
    check_prompt_logits(engines, (1, 40, 90), seed=70)


def check_batched_decode(engines, prompts, first_id: int, steps: int) -> None:
    """Every engine prefills `prompts` in one step and decodes them together `steps` times: the gpus' tokens
    equal the cpu backend's, their logits rows within TOLERANCE."""
    name, cpu, gpus = engines
    outs = {}
    ids = [first_id + i for i in range(len(prompts))]
    for label, engine in [("cpu", cpu), *gpus.items()]:
        first = engine.step([PrefillInput(s, np.array(p), SamplingParams(), True) for s, p in zip(ids, prompts)])
        tokens, rows = [[o.token_id] for o in first.outputs], [[r] for r in first.logits]
        for _ in range(steps):
            step = engine.step(decode_ids=ids)
            for i, o in enumerate(step.outputs):
                tokens[i].append(o.token_id)
                rows[i].append(step.logits[i])
        engine.clear()
        outs[label] = (tokens, rows)
    for mode in gpus:
        assert outs[mode][0] == outs["cpu"][0], f"{name} {mode}"
        for a, b in zip(outs[mode][1], outs["cpu"][1]):
            got = np.stack(a)
            assert np.isfinite(got).all() and rel_error(got, np.stack(b)) <= TOLERANCE, f"{name} {mode}"


def check_prompt_logits(engines, lengths, seed: int) -> None:
    """Prompt logits of random prompts of `lengths` tokens: the gpus' within TOLERANCE of the cpu backend's."""
    name, cpu, gpus = engines
    for n in lengths:
        ids = random_prompt(seed + n, n)
        want = cpu.prompt_logits(ids)
        for mode, gpu in gpus.items():
            got = gpu.prompt_logits(ids)
            assert np.all(np.isfinite(got)) and rel_error(got, want) <= TOLERANCE, f"{name} {mode} n={n}"


@pytest.mark.serial
# int8: the 8-bit LM head (linear_q8) too, then the attention projections as well
@pytest.mark.parametrize("head, attention", [(None, None), ("int8", None), ("int8", "int8")])
def test_no_device_allocations_during_quantized_steps(tmp_path, monkeypatch, head, attention):
    from cuda.bindings import driver as drv
    from numba.cuda.cudadrv import driver

    model = ModelDir.open(quantized_model(tmp_path, "qwen3_moe", "mixed", head=head, attention=attention))
    assert (model.head_format and model.head_format.dtype) == head
    assert (model.attention_format and model.attention_format.dtype) == attention
    gpu = build_engine(model, EngineConfig(backend="cuda", **CFG))
    gpu.warmup()
    gpu.step([PrefillInput(5, np.array(random_prompt(5, 9)), SamplingParams(), True)])
    free_before = drv.cuMemGetInfo()[1]
    calls = []
    original = driver.Context.memalloc
    monkeypatch.setattr(driver.Context, "memalloc", lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    gpu.step([PrefillInput(6, np.array(random_prompt(6, 100)), SamplingParams(), True)], decode_ids=[5])
    for _ in range(4):
        gpu.step(decode_ids=[5, 6])
    gpu.clear()
    assert calls == [], f"{len(calls)} device allocations during steps"
    assert drv.cuMemGetInfo()[1] == free_before, "device memory changed during steps"


Q8_MMA_OFF = CudaOptions(q8_mma_min_tokens=1 << 20)


def prefill_routing(engine, token_ids) -> dict[int, np.ndarray]:
    """The experts a prefill of token_ids sends each token to: {layer: sorted expert ids [n, K]} (the step's
    trace; prompt_logits pads the prompt to the same bucket, so its layers see the same routing)."""
    result = engine.step([PrefillInput(300, np.asarray(token_ids), SamplingParams(), True)])
    engine.clear()
    return {layer: np.sort(ids, axis=-1) for layer, ids in result.trace.expert_ids.items()}


def comparable_rows(routes, other, num_layers: int) -> np.ndarray:
    """Prompt positions whose logits two engines must agree on although a near-tie in a router sent a token to
    different experts (Q8_MMA's bf16 roundings move router logits by ~5e-3; on the cpu backend the tiny mixtral
    has a 64-token prompt with a layer-2 top-2 gap of 9e-3, and that one token's other expert moves the logits
    by 0.12): a token routed differently in the last layer spoils only its own row, in an earlier layer every
    row from it on (the later layers attend to it)."""
    layers = sorted(routes)
    assert layers and layers == sorted(other), "both engines trace every MoE layer"
    assert (routes[layers[0]] == other[layers[0]]).all(), "the first MoE layer sees identical inputs"
    n = routes[layers[0]].shape[0]
    keep = np.ones(n, bool)
    for layer in layers:
        differ = np.flatnonzero((routes[layer] != other[layer]).any(axis=-1))
        for p in differ:
            keep[p if layer == num_layers - 1 else slice(p, None)] = False
    return keep


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", ["int8", "fp8-block128", "mixed-8bit"])
def test_q8_mma_matches_the_simt_and_cublas_paths(tmp_path, family, variant):
    model = quantized_model(tmp_path, family, variant, dense="bfloat16")  # the tensor-core kernel reads bf16 x
    engines = {
        name: build_engine(ModelDir.open(model), EngineConfig(backend="cuda", cuda_options=options, **CFG))
        for name, options in (("q8_mma", CudaOptions()), ("off", Q8_MMA_OFF))
    }
    moe = engines["q8_mma"].decoder.model.moe
    shipped = CudaOptions()  # the tiny models have few experts: Q8_MMA from 2 tokens up to the few-expert limit
    assert moe.q8_mma == (shipped.q8_mma_min_tokens, shipped.q8_mma_max_tokens_few_experts) == (2, 512)
    num_layers = ModelDir.open(model).config.num_hidden_layers
    for n in (2, 5, 33, 64, 200):  # 200: past the old 64-token limit, cuBLAS on the "off" engine
        ids = random_prompt(90 + n, n)
        got, want = (engines[k].prompt_logits(ids) for k in ("q8_mma", "off"))
        keep = comparable_rows(*(prefill_routing(engines[k], ids) for k in ("q8_mma", "off")), num_layers)
        assert keep.sum() >= n - 2, f"{family}/{variant} n={n}: {n - keep.sum()} rows routed apart (near-ties are rare)"
        assert np.isfinite(got).all(), f"{family}/{variant} n={n}"
        assert rel_error(got[keep], want[keep]) <= TOLERANCE, f"{family}/{variant} n={n}"
    prompts = [random_prompt(60 + i, n) for i, n in enumerate((3, 9, 40))]
    for p in prompts:
        assert engines["q8_mma"].generate(p, 8)[0] == engines["off"].generate(p, 8)[0], f"{family}/{variant}"


@pytest.mark.parametrize("family", FAMILIES)
def test_overlapped_dequant_equals_the_in_order_pass(tmp_path, monkeypatch, family):
    """Per-expert cuBLAS on 8-bit experts (Q8_MMA off: every step over 64 tokens) with scratch halves of one
    expert, so a step runs many groups: the next group widened on the side stream while this one's GEMMs run
    gives the same bits as widening and GEMMs in turn, and as one group of every expert (each expert's GEMMs
    read the same dense values whichever half holds them)."""
    from expert_service.cuda import moe

    model = quantized_model(tmp_path, family, "int8", dense="bfloat16")
    cfg = ModelDir.open(model).config
    build = lambda options: build_engine(  # noqa: E731
        ModelDir.open(model), EngineConfig(backend="cuda", cuda_options=options, **CFG)
    )
    whole = build(Q8_MMA_OFF)
    assert whole.decoder.ws.dequant.shape[0] == 2 * cfg.num_experts  # the tiny experts: all in one group
    one_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 2  # bf16 scratch
    monkeypatch.setattr(moe, "DEQUANT_SCRATCH_BYTES", 2 * one_expert)
    overlapped = build(Q8_MMA_OFF)
    in_order = build(CudaOptions(q8_mma_min_tokens=1 << 20, overlap_dequant=False))
    assert overlapped.decoder.ws.dequant.shape[0] == 2  # two halves of one expert
    for n in (100, 300, 512):
        ids = random_prompt(700 + n, n)
        want = whole.prompt_logits(ids)
        assert np.isfinite(want).all()
        for name, engine in (("overlapped", overlapped), ("in order", in_order)):
            assert np.array_equal(engine.prompt_logits(ids), want), f"{family} {name} n={n}"
    for engine in (whole, overlapped, in_order):
        engine.decoder.close()


# W8A8 (CudaOptions.q8_activations): D and F whole 128-feature steps, few experts so a 400-token step has 96+ rows an
# expert (the 128-row tile) and smaller ones 10-50 (the 64-row tile, or none, by w8a8_min_rows and the token bucket)
W8A8_MODEL = dict(hidden_size=128, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2)  # mixtral keys
W8A8_TOLERANCE = 4e-2  # against the cpu backend emulating W8A8: bf16 elsewhere moves a few values across 8-bit
# steps (H200: up to 3.2e-2, fp8 block128 at 512 tokens; W8A8 itself moves these logits by 0.2-0.3)


@pytest.mark.parametrize("variant", ["int8", "fp8-block128", "fp8-channel"])
def test_w8a8_prefill_matches_the_emulated_cpu_backend(tmp_path, monkeypatch, variant):
    """On an sm_90 device, with the default options: prefills of w8a8_min_rows+ rows an expert launch the W8A8 kernels
    (smaller ones do not) and match the cpu backend running W8A8's arithmetic (quantize_rows.w8a8_swiglu_reference) on the
    same routing; graph replay equals eager bit for bit; decode (never W8A8) gives the same tokens as the engine
    without the option."""
    import expert_service.cuda.moe_grouped_mma as grouped
    from expert_service.cpu.layers import moe as cpu_moe
    from expert_service.kernels.expert_quant import CODE_FP8, CODE_INT8
    from expert_service.kernels.quantize_rows import w8a8_swiglu_reference
    from tests.expert_service.cuda.test_decoder import ForcedRouting, last_step_expert_ids
    from tests.helpers import bf16_tiny

    if not grouped.hopper():
        pytest.skip("W8A8 runs on warpgroup MMA: an sm_90 device")
    bf16 = bf16_tiny(tmp_path / "bf16", "mixtral", 13, **W8A8_MODEL)
    dtype, _, scale = variant.partition("-")
    model = convert(
        bf16.parent / "hf",
        tmp_path / variant,
        "bfloat16",
        progress=False,
        expert_dtype=dtype,
        fp8_scale=scale or None,
    )
    launches = []
    original = grouped.launch_w8a8_gate_up
    monkeypatch.setattr(grouped, "launch_w8a8_gate_up", lambda *a, **k: (launches.append(1), original(*a, **k)))
    w8a8 = CudaOptions()  # the defaults run it
    open_ = lambda **kw: build_engine(ModelDir.open(model), EngineConfig(**{**CFG, **kw}))  # noqa: E731
    graphs, eager = (
        open_(backend="cuda", cuda_options=w8a8),
        open_(backend="cuda", cuda_options=w8a8, cuda_graphs=False),
    )
    plain, cpu = open_(backend="cuda", cuda_options=CudaOptions(q8_activations=False)), open_(backend="cpu")
    # every layer runs W8A8, so these 8 experts take Q8_MMA at every size; without it, up to 512 tokens
    assert graphs.decoder.model.moe.q8_mma == (2, CudaOptions().q8_mma_max_tokens)
    assert plain.decoder.model.moe.q8_mma == (2, CudaOptions().q8_mma_max_tokens_few_experts)
    code = CODE_INT8 if dtype == "int8" else CODE_FP8
    monkeypatch.setattr(cpu_moe, "swiglu_mlp", lambda x, g, u, d: w8a8_swiglu_reference(x, g, u, d, code))
    forced = ForcedRouting(monkeypatch)
    rows_from = CudaOptions().w8a8_min_rows  # rows per routed expert from which a step takes it (n * K / E here)
    for n in (40, 100, 200, 400, 512):
        padded = eager.decoder._prefill_bucket(n) or n  # a step runs as its token bucket: 100 tokens as 128
        takes_it = padded * 2 // 8 >= rows_from
        ids = random_prompt(300 + n, n)
        before = len(launches)  # counted eagerly (a replayed graph calls no launcher)
        got = eager.prompt_logits(ids)
        assert (len(launches) > before) == takes_it, f"{variant} n={n}: W8A8 launched {len(launches) - before}x"
        assert np.isfinite(got).all(), f"{variant} n={n}"
        assert np.array_equal(graphs.prompt_logits(ids), got), f"{variant} n={n}: graph replay differs from eager"
        if takes_it:  # the cpu backend routed as the GPU was (bf16 and fp32 break router near-ties apart)
            forced.queue = last_step_expert_ids(graphs, n)
            err = rel_error(got, cpu.prompt_logits(ids))
            assert err <= W8A8_TOLERANCE, f"{variant} n={n}: {err:.2e}"
        else:
            assert np.array_equal(plain.prompt_logits(ids), got), f"{variant} n={n}: below the tile, as without it"
    for p in (random_prompt(70, 5), random_prompt(71, 30)):
        assert graphs.generate(p, 8)[0] == plain.generate(p, 8)[0], variant
    for engine in (graphs, eager, plain):
        engine.decoder.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_decode_activations_match_the_emulated_cpu_backend(tmp_path, monkeypatch, family):
    """CudaOptions.q8_decode_activations on an int8 model, Q8_MMA off so every step up to 64 tokens runs moe_q8:
    one-token steps launch moe_q8_dp4a and larger ones moe_q8_dp4a_grouped, once a MoE layer each; tokens and
    logits of one sequence and of three decoding together match the cpu backend running the same int8 roundings
    of the tokens and the SwiGLU rows (moe_q8_dp4a.dp4a_swiglu_reference); graph replay equals eager bit for bit;
    without the option neither launches."""
    import expert_service.cuda.moe as device_moe
    from expert_service.cpu.layers import moe as cpu_moe
    from expert_service.kernels.moe_q8_dp4a import dp4a_swiglu_reference

    model = quantized_model(tmp_path, family, "int8")
    launches = {"slot": 0, "grouped": 0}
    for kind, name in (("slot", "launch_dp4a_gate_up"), ("grouped", "launch_dp4a_grouped_gate_up")):
        original = getattr(device_moe, name)

        def counted(*a, kind=kind, original=original, **k):
            launches[kind] += 1
            return original(*a, **k)

        monkeypatch.setattr(device_moe, name, counted)
    small = 1 << 20  # q8_mma_min_tokens: no step takes Q8_MMA
    on, off = (CudaOptions(q8_decode_activations=a, q8_mma_min_tokens=small) for a in (True, False))
    open_ = lambda **kw: build_engine(ModelDir.open(model), EngineConfig(**{**CFG, **kw}))  # noqa: E731
    graphs, eager = open_(backend="cuda", cuda_options=on), open_(backend="cuda", cuda_options=on, cuda_graphs=False)
    plain, cpu = open_(backend="cuda", cuda_options=off), open_(backend="cpu")
    exact = cpu_moe.swiglu_mlp
    moe_layers = len(ModelDir.open(model).config.moe_layers)
    steps = 6

    def decode(engine, seqs: int):
        ids = list(range(7, 7 + seqs))
        prompts = [PrefillInput(s, np.array(random_prompt(90 + s, 4 * s - 23)), SamplingParams(), True) for s in ids]
        first = engine.step(prompts)  # 5, 9 and 13 tokens: one step of <= 64, grouped
        tokens, rows = [[o.token_id for o in first.outputs]], []
        for _ in range(steps):
            step = engine.step(decode_ids=ids)
            tokens.append([o.token_id for o in step.outputs])
            rows.append(np.stack(step.logits))
        engine.clear()
        return tokens, np.stack(rows)

    for seqs in (1, 3):
        before = dict(launches)
        tokens, logits = decode(eager, seqs)
        per_step = "slot" if seqs == 1 else "grouped"
        want = {"slot": 0, "grouped": moe_layers}  # the prefill step
        want[per_step] += steps * moe_layers
        assert {k: launches[k] - before[k] for k in launches} == want, f"{family} {seqs} sequences"
        replayed = decode(graphs, seqs)
        assert replayed[0] == tokens and np.array_equal(replayed[1], logits), f"{family}: graph replay differs"
        monkeypatch.setattr(cpu_moe, "swiglu_mlp", dp4a_swiglu_reference)
        emulated = decode(cpu, seqs)
        monkeypatch.setattr(cpu_moe, "swiglu_mlp", exact)
        assert tokens == emulated[0], f"{family} {seqs} sequences"
        err = rel_error(logits, emulated[1])
        assert err <= TOLERANCE, f"{family} {seqs} sequences: {err:.2e}"
        before = dict(launches)
        decode(plain, seqs)
        assert launches == before, f"{family}: launched without the option"
    for engine in (graphs, eager, plain):
        engine.decoder.close()
