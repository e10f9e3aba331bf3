"""The cpu backend's start-up memory plan: each line is what the decoder holds, and the expert lines mean what the
cuda backend's mean (under the expert cache the experts stay in the model's mmap: only the slots are held)."""

from __future__ import annotations

import pytest

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.tools.convert import convert
from expert_service.tools.tiny_model import write_tiny_checkpoint


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> ModelDir:
    """bf16 dense weights and int8 experts: every stored size differs from the float32 this backend holds."""
    tmp = tmp_path_factory.mktemp("m")
    hf = write_tiny_checkpoint(tmp / "hf", "mixtral", seed=1)
    return ModelDir.open(convert(hf, tmp / "m", "bfloat16", False, expert_dtype="int8"))


def held_expert_bytes(decoder) -> int:
    """Float32 bytes of every expert once each has been used (CpuWeights converts them on first use)."""
    for layer in decoder.config.moe_layers:
        for expert in range(decoder.config.num_experts):
            decoder.w.expert(layer, expert)
    return sum(a.nbytes for matrices in decoder.w._experts.values() for a in matrices)


@pytest.mark.parametrize("slots", [0, 2])
def test_the_memory_plan_is_what_the_decoder_holds(bf16_model, slots):
    engine = build_engine(bf16_model, EngineConfig(backend="cpu", kv_block_size=4, expert_cache_slots=slots))
    decoder = engine.decoder
    try:
        assert bf16_model.dtype == "bfloat16"
        plan = dict(decoder.memory_plan())
        assert plan["dense_weights"] == sum(a.nbytes for a in decoder.w.dense.values())
        assert plan["kv_cache"] == decoder.kv.nbytes and plan["penalties"] == decoder.penalties.nbytes
        if slots:  # the host copy is the model's mmap, as on the cuda backend (expert_weights 0 there too)
            assert plan["expert_weights"] == 0 and plan["expert_slots"] == decoder.copy_engine.nbytes
        else:
            assert plan["expert_weights"] == held_expert_bytes(decoder) and "expert_slots" not in plan
    finally:
        decoder.close()
