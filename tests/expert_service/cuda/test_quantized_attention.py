"""The cuda backend with 8-bit attention projections (linear_q8 up to TOK_TILE rows, moe_gemm_q8mma past it, and from
CudaOptions.attention_8bit_dense_rows tokens each projection widened for cuBLAS; o_proj adding into the residual on
each) against the cpu backend on the same converted model (GPU only): int8 and fp8, every family (Qwen2-MoE's q/k/v
biases, OLMoE's full-width q/k norms, Qwen3-MoE's per-head ones), beside 8-bit experts and an 8-bit head. The cpu
runs each step with the GPU's routing and tokens (these tiny routers have near-ties that bf16 and fp32 break apart,
and one token routed elsewhere moves its whole output), and the routing is checked apart: logits of greedy decode,
batched decode and prompts within the bf16 tolerance, greedy tokens the cpu's argmax up to it, graphs and eager,
q|k|v fused at one token and not, large steps widened and on the 8-bit GEMM."""

import dataclasses

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.tools.convert import convert
from tests.expert_service.cuda.test_decoder import ForcedRouting, last_step_expert_ids, replay_on_cpu
from tests.expert_service.cuda.test_quantized import (
    CFG,
    EXACT_ACTIVATIONS,
    TOLERANCE,
)
from tests.expert_service.tools.head_checkpoint import head_config, write_head_checkpoint
from tests.helpers import random_prompt, rel_error

pytestmark = pytest.mark.gpu
WIDENED_FROM = 16  # the eager engine widens steps from this many tokens: its 40-token prompts, not its decodes

# (family, attention dtype, expert dtype, head dtype)
VARIANTS = [
    ("qwen3_moe", "int8", None, None),
    ("qwen2_moe", "int8", "int8", None),
    ("mixtral", "fp8", None, "int8"),
    ("olmoe", "int8", "int8", "int8"),
    ("qwen3_moe", "fp8", "fp8", "float8_e4m3fn"),
]


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda p: "-".join(str(v) for v in p))
def engines(request, tmp_path_factory):
    family, attention, experts, head = request.param
    root = tmp_path_factory.mktemp(f"{family}-{attention}")
    write_head_checkpoint(root / "hf", head_config(family, tied=family == "qwen3_moe"), seed=17)
    model = convert(
        root / "hf", root / "m", "bfloat16", False, expert_dtype=experts, head_dtype=head, attention_dtype=attention
    )
    assert ModelDir.open(model).attention_format is not None
    open_ = lambda **kw: build_engine(ModelDir.open(model), EngineConfig(**{**CFG, **kw}))  # noqa: E731
    unfused = dataclasses.replace(EXACT_ACTIVATIONS, fused_qkv=False)
    gpus = {
        "graphs": open_(backend="cuda", cuda_options=EXACT_ACTIVATIONS),
        # the 40-token prompts widened for cuBLAS here, the 6-row decodes (as 8: the step buckets) on the 8-bit GEMM
        "eager": open_(
            backend="cuda",
            cuda_options=dataclasses.replace(EXACT_ACTIVATIONS, attention_8bit_dense_rows=WIDENED_FROM),
            cuda_graphs=False,
        ),
        "unfused": open_(backend="cuda", cuda_options=unfused),
        # every large step on the 8-bit GEMM
        "never_widened": open_(
            backend="cuda", cuda_options=dataclasses.replace(EXACT_ACTIVATIONS, attention_8bit_dense_rows=0)
        ),
    }
    thresholds = {mode: gpu.decoder.model.attention_8bit.rows.dense_min_rows for mode, gpu in gpus.items()}
    # the default widens the 300-token prompts under graphs; the never-widened engine runs them on the 8-bit GEMM
    assert 1 < thresholds["graphs"] <= 300 and thresholds["eager"] == WIDENED_FROM and thresholds["never_widened"] == 0
    return "-".join(str(v) for v in request.param), open_(backend="cpu"), gpus


def test_greedy_tokens_match_cpu(engines, monkeypatch):
    """Ten greedy tokens after one prompt (one row, a token tile, past it, many tiles): each the cpu's argmax up to
    the bf16 tolerance, the cpu fed the GPU's tokens and routing step by step, the routing checked apart."""
    forced = ForcedRouting(monkeypatch)
    for i, n in enumerate((1, 3, 6, 70)):
        check_batched_decode_routed(engines, forced, [random_prompt(40 + i, n)], first_id=300 + i, steps=9)
    forced.assert_only_ties(engines[0])


def test_batched_decode_logits_close_to_cpu(engines, monkeypatch):
    prompts = [random_prompt(70 + i, n) for i, n in enumerate((3, 9, 40, 80, 5, 17))]  # 6 rows: past one token tile
    forced = ForcedRouting(monkeypatch)
    check_batched_decode_routed(engines, forced, prompts, first_id=400, steps=4)
    check_batched_decode_routed(engines, forced, prompts[:3], first_id=410, steps=3)  # 3 rows: one token tile
    forced.assert_only_ties(engines[0])


def check_batched_decode_routed(engines, forced: ForcedRouting, prompts, first_id: int, steps: int) -> None:
    """Each GPU engine prefills `prompts` in one step and decodes them together `steps` times; the cpu backend then
    runs the same steps fed the GPU's tokens and routing (replay_on_cpu)."""
    name, cpu, gpus = engines
    rids = [first_id + i for i in range(len(prompts))]
    prefill = [PrefillInput(r, np.array(p), SamplingParams(), True) for r, p in zip(rids, prompts)]
    for mode, gpu in gpus.items():
        runs = []
        for n in range(steps + 1):
            step = gpu.step(prefill) if n == 0 else gpu.step(decode_ids=rids)
            runs.append(([o.token_id for o in step.outputs], np.stack(list(step.logits)), step.trace))
        gpu.clear()
        assert all(np.isfinite(logits).all() for _, logits, _ in runs), f"{name} {mode}"
        replay_on_cpu(cpu, forced, runs, prefill, rids, gpu.decoder.moe_layers, f"{name} {mode}")


def test_prompt_logits_close_to_cpu(engines, monkeypatch):
    """The cpu backend routed as each GPU engine did (a tiny router's near-ties, which bf16 and fp32 break apart, would
    otherwise move a whole token's output): the arithmetic within the bf16 tolerance, and the GPU off the cpu's own
    top-k only at such ties."""
    name, cpu, gpus = engines
    forced = ForcedRouting(monkeypatch)
    for n in (1, 4, 40, 300):
        ids = random_prompt(90 + n, n)
        for mode, gpu in gpus.items():
            got = gpu.prompt_logits(ids)
            forced.queue = last_step_expert_ids(gpu, n)
            err = rel_error(got, cpu.prompt_logits(ids))
            assert not forced.queue and np.isfinite(got).all()
            assert err <= TOLERANCE, f"{name} {mode} n={n}: {err:.2e}"
    forced.assert_only_ties(name)


# (family, attention dtype, expert dtype, head dtype): the variants whose logits left the cpu backend's by more than
# the bf16 tolerance on an H200, and one that did not
APART = [
    ("qwen2_moe", "int8", "int8", None),
    ("qwen3_moe", "fp8", "fp8", "float8_e4m3fn"),
    ("mixtral", "fp8", None, "int8"),
    ("qwen3_moe", "int8", None, None),
]


@pytest.mark.parametrize("variant", APART, ids=lambda p: "-".join(str(v) for v in p))
def test_8bit_projections_add_little_to_the_gpus_distance_from_the_cpu(tmp_path, monkeypatch, variant):
    """The same checkpoint converted twice, projections 8-bit and dense: on each, the cuda engine's prompt logits
    against the cpu backend's (routed as the GPU did). What the 8-bit path adds to the GPU's distance from the exact
    reference (its bf16 rounding of the rows past 4, as cuBLAS rounds the dense path's) stays within the bf16
    tolerance; a larger distance that the dense projections share is the rest of the GPU path's, not theirs."""
    family, attention, experts, head = variant
    write_head_checkpoint(tmp_path / "hf", head_config(family, tied=family == "qwen3_moe"), seed=17)
    forced = ForcedRouting(monkeypatch)
    errors = {}
    for label, dtype in (("8bit", attention), ("dense", None)):
        model = convert(
            tmp_path / "hf", tmp_path / label, "bfloat16", False, expert_dtype=experts, head_dtype=head,
            attention_dtype=dtype,
        )  # fmt: skip
        cpu = build_engine(ModelDir.open(model), EngineConfig(**{**CFG, "backend": "cpu"}))
        gpu = build_engine(
            ModelDir.open(model), EngineConfig(**{**CFG, "backend": "cuda", "cuda_options": EXACT_ACTIVATIONS})
        )
        for n in (1, 6, 40, 300):
            ids = random_prompt(90 + n, n)
            got = gpu.prompt_logits(ids)
            forced.queue = last_step_expert_ids(gpu, n)  # the cpu routed as the GPU did: the arithmetic compared
            errors[label, n] = rel_error(got, cpu.prompt_logits(ids))
        gpu.decoder.close()
    report = {f"{label} n={n}": f"{err:.2e}" for (label, n), err in errors.items()}
    for n in (1, 6, 40, 300):
        assert errors["8bit", n] <= errors["dense", n] + TOLERANCE, (n, report, forced.worst_tie)
    forced.assert_only_ties(f"{'-'.join(str(v) for v in variant)} {report}")
