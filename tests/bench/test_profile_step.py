"""bench/profile_step.py's host-side parts (the profile itself needs a GPU and torch): the random
model and routing plans it runs, the CudaOptions of its variants, the fused-vs-unfused comparison."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from bench import profile_step
from expert_service.engine.cuda_options import CudaOptions


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_random_model_opens_with_the_shape_asked_for(tmp_path, family, monkeypatch):
    from common.model_format import ModelDir

    monkeypatch.setattr(profile_step, "POOL_ELEMENTS", 3000)  # tensors larger than the pool are tiled
    params = {
        "vocab_size": 300,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    params.update(
        {"intermediate_size": 96, "num_local_experts": 8, "num_experts_per_tok": 2}
        if family == "mixtral"
        else {"moe_intermediate_size": 32, "head_dim": 16, "num_experts": 16, "num_experts_per_tok": 4}
    )
    model = ModelDir.open(profile_step.write_random_model(family, params, tmp_path / "m"))  # checks every crc32
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (300, 64, 2, 16)
    assert cfg.num_experts == (8 if family == "mixtral" else 16)
    from common.dtypes import bf16_to_float32

    norm = bf16_to_float32(np.asarray(model.tensor("layers.0.input_norm")))
    router = bf16_to_float32(np.asarray(model.tensor("layers.1.router")))
    assert np.all(norm == 1.0)
    assert 0.01 < router.std() < 0.04 and len(np.unique(router)) > router.size // 2  # fresh values
    embed = bf16_to_float32(np.asarray(model.tensor("embed_tokens")))
    assert np.isfinite(embed).all() and 0.01 < embed.std() < 0.04


def test_random_plan_routes_every_token_to_distinct_experts():
    rng = np.random.default_rng(0)
    plan = profile_step.random_plan([0, 2, 3], 50, 16, 4, rng)
    ids = plan.expert_ids(16, 50, 4)  # the worker's checks: K distinct experts per token
    assert set(ids) == {0, 2, 3}
    counts = np.bincount(np.concatenate([v.ravel() for v in ids.values()]), minlength=16)
    assert counts.min() > 0  # uniform: every expert gets tokens at this size


def test_variants_map_onto_cuda_options():
    for variant in profile_step.VARIANTS:  # every name a CudaOptions field: no typo runs the fused path
        options = profile_step.variant_options(variant)
        shipped = asdict(CudaOptions())
        assert {k for k, v in asdict(options).items() if v != shipped[k]} == set(profile_step.VARIANTS[variant]), (
            variant
        )
    assert profile_step.variant_options("fused") == profile_step.variant_options("lut") == CudaOptions()
    assert profile_step.variant_options("unfused") == CudaOptions(
        fused_rope_kv=False, fused_combine_norm=False, fused_qk_norm=False
    )


def test_compare_lists_the_kernels_that_changed():
    fused = profile_step.summarise(
        {
            "rope_kv_write_kernel": [10.0, 8],
            "gemv": [100.0, 40],
            "moe_combine_rmsnorm_kernel": [7.0, 7],
            "rmsnorm_kernel": [3.0, 10],
        },
        500.0,
    )
    unfused = profile_step.summarise(
        {
            "rope_kernel": [9.0, 8],
            "kv_write_kernel": [4.0, 8],
            "gemv": [100.2, 40],
            "_moe_combine_kernel": [8.0, 8],
            "rmsnorm_kernel": [5.0, 17],
        },
        530.0,
    )
    diff = profile_step.compare(fused, unfused)
    assert diff["device_busy_us"] == pytest.approx(120.0 - 126.2) and diff["wall_us"] == pytest.approx(-30.0)
    assert "gemv" not in diff["kernels"]  # same launches, within half a microsecond
    assert diff["kernels"]["rope_kernel"] == {"us": -9.0, "launches": -8}
    assert diff["kernels"]["rmsnorm_kernel"] == {"us": -2.0, "launches": -7}
    assert list(diff["kernels"])[0] == "rope_kv_write_kernel"  # largest change first


@pytest.mark.parametrize("lut", [False, True])
def test_scenarios_run_their_steps_on_the_cpu_backend(tiny_model, monkeypatch, lut):
    """The scenario flow (prefill chunks, decode sequences kept across variants, random plans under lut) on the
    cpu engine, with the profiler replaced by a counter of the steps it would record."""
    from common.model_format import ModelDir
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig

    engine = build_engine(
        ModelDir.open(tiny_model),
        EngineConfig(
            backend="cpu",
            kv_block_size=4,
            kv_cache_tokens=4096,
            max_batch_tokens=256,
            routing="lut" if lut else "exact",
        ),
    )
    dropped, steps = [], []
    engine.decoder.drop_graphs = lambda: dropped.append(1)
    original_step = engine.step
    monkeypatch.setattr(engine, "step", lambda *a, **k: steps.append(k.get("routing_plan")) or original_step(*a, **k))

    def fake_profile(fn, repeats):
        for _ in range(repeats + 1):
            fn()
        return {"k": [1.0, 1.0]}, 10.0

    monkeypatch.setattr(profile_step, "kernel_totals", fake_profile)
    monkeypatch.setitem(profile_step.SCENARIOS, "prefill_2x16", ("prefill", 2, 16))
    monkeypatch.setitem(profile_step.SCENARIOS, "decode_3", ("decode", 3, 8))
    runner = profile_step.Scenarios(engine, 259, lut)
    for scenario in ("prefill_2x16", "decode_3", "decode_3"):  # a second variant reuses the sequences
        assert runner.run(scenario)["device_busy_us"] == 1.0
    assert len(dropped) == 2 and sorted(engine.sequences) == runner.decoding[3]
    assert all((plan is not None) == lut for plan in steps)
    # prefill: 5 passes (eager, capture, 3 profiled); decode: one prefill of the 3 sequences, then 2 + 11 steps
    # per variant
    assert len(steps) == 5 + 1 + 2 * 13
    assert all(engine.sequences[i].num_cached == 8 + 2 * 13 for i in runner.decoding[3])


def test_host_profile_counts_calls_a_step_and_ranks_own_time():
    """Three steps of a function that calls a slow helper once and a fast one 50 times: 52 calls a step (the step
    function itself included), the slow helper first by own time."""
    import time

    def slow():
        time.sleep(0.002)

    def fast():
        return None

    def step():
        slow()
        for _ in range(50):
            fast()

    synced = []
    host = profile_step.host_profile(step, 3, 2, lambda: synced.append(1))
    assert synced == [1, 1, 1]
    assert 52 <= host["calls_per_step"] <= 57  # the step, its 51 calls, the sync lambda, list.append, cProfile's own
    first = next(iter(host["top_own_time"]))
    assert "sleep" in first or "slow" in first
    assert next(iter(host["top_own_time"].values())) >= 1500  # us a step
    assert next(iter(host["top_cumulative"].values())) >= 1500  # the step itself, with what it calls
    (slowest, callers), *_ = host["callers"].items()
    assert slowest == first and any("slow" in c or "step" in c for c in callers)
