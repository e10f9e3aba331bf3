"""Which backend the worker runs, and the reason it says at start-up (no GPU needed)."""

from __future__ import annotations

import logging

import pytest

from common.errors import ConfigError
from common.model_format import ModelDir
from expert_service import backends as backends
from expert_service.backends import build_engine, resolve_backend
from expert_service.engine.config import Backend, EngineConfig
from expert_service.tools.tiny_model import make_tiny


@pytest.mark.parametrize(
    "usable, why, want",
    [(True, "NVIDIA H200 found", Backend.CUDA), (False, "numba-cuda is not installed (the cuda extra)", Backend.CPU)],
)
def test_auto_follows_the_gpu_and_says_why(monkeypatch, usable, why, want):
    monkeypatch.setattr(backends, "cuda_status", lambda: (usable, why))
    assert resolve_backend(Backend.AUTO) == (want, f"auto: {why}")


def test_an_explicit_backend_is_taken_as_asked(monkeypatch):
    monkeypatch.setattr(backends, "cuda_status", lambda: pytest.fail("an explicit backend probes nothing"))
    assert resolve_backend(Backend.CPU) == (Backend.CPU, "--backend cpu")
    assert resolve_backend(Backend.CUDA) == (Backend.CUDA, "--backend cuda")


def test_the_engine_logs_its_backend_and_the_reason(tmp_path, monkeypatch, caplog):
    model = ModelDir.open(make_tiny(tmp_path / "m", family="mixtral", seed=1, progress=False))
    monkeypatch.setattr(backends, "cuda_status", lambda: (False, "no usable NVIDIA GPU or driver was found"))
    with caplog.at_level(logging.INFO, logger="colibri.worker"):
        build_engine(model, EngineConfig(backend="auto", kv_cache_tokens=256))
    assert "backend cpu (auto: no usable NVIDIA GPU or driver was found)" in caplog.messages


def test_cuda_without_a_gpu_is_one_line_naming_the_reason(tmp_path, monkeypatch):
    model = ModelDir.open(make_tiny(tmp_path / "m", family="mixtral", seed=1, progress=False))
    monkeypatch.setattr(backends, "cuda_status", lambda: (False, "NUMBA_ENABLE_CUDASIM=1 is set"))
    with pytest.raises(ConfigError) as err:
        build_engine(model, EngineConfig(backend="cuda", kv_cache_tokens=256))
    assert str(err.value) == (
        "backend: cuda was asked for but NUMBA_ENABLE_CUDASIM=1 is set (use --backend cpu or auto)"
    )


@pytest.mark.parametrize("expert_dtype", ["int8", "fp8"])
def test_the_cuda_expert_cache_takes_8bit_experts(tmp_path, monkeypatch, expert_dtype):
    """A cached 8-bit model goes to the cuda decoder with its slot plan (the slots hold blocks as stored; the
    decoder itself is stubbed here: no GPU)."""
    import sys
    from types import ModuleType

    model = ModelDir.open(make_tiny(tmp_path / "m", family="mixtral", seed=1, expert_dtype=expert_dtype))
    monkeypatch.setattr(backends, "cuda_status", lambda: (True, "NVIDIA H200 found"))
    built = []

    class Reached(Exception):
        pass

    def decoder(*args):
        built.append(args)
        raise Reached

    stub = ModuleType("expert_service.cuda.decoder")
    stub.CudaDecoder = decoder  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "expert_service.cuda.decoder", stub)
    with pytest.raises(Reached):
        build_engine(model, EngineConfig(backend="cuda", kv_cache_tokens=256, expert_cache_slots=1))
    ((got_model, _, slot_plan),) = built
    assert got_model is model and slot_plan.is_cached and slot_plan.slots_per_layer == 1
    assert slot_plan.expert_block_bytes == model.max_expert_nbytes


@pytest.mark.parametrize("name", ["NVIDIA H200", b"NVIDIA H200"])
def test_cuda_status_names_the_device_whatever_type_numba_gives(monkeypatch, name):
    """numba-cuda 0.30 gives the device name as str, older releases as bytes: either is named, neither fails."""
    from types import SimpleNamespace

    from numba import cuda
    from numba.cuda import config

    monkeypatch.setattr(config, "ENABLE_CUDASIM", False)
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "get_current_device", lambda: SimpleNamespace(name=name))
    assert backends.cuda_status() == (True, "NVIDIA H200 found")


@pytest.mark.parametrize(
    ("experts", "top_k", "slots"),
    [
        (backends.CUDA_MAX_EXPERTS + 1, 2, 0),
        (backends.CUDA_MAX_EXPERTS + 7, 2, 2),
        (16, backends.CUDA_MAX_TOP_K + 1, 0),
    ],
)
def test_the_cuda_backend_refuses_a_model_its_routing_kernels_cannot_route_at_start_up(
    tmp_path, monkeypatch, experts, top_k, slots
):
    """A model of more than 256 experts a layer (or 8 a token) raised a ValueError traceback from a gate kernel's
    launcher at the first step, and one of more than 1024 from the slot map's while the decoder was built; the
    worker now refuses either in one line before building the decoder, resident or cached."""
    import sys
    from types import ModuleType

    from tests.helpers import bf16_tiny

    overrides = dict(num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=16)
    model = ModelDir.open(bf16_tiny(tmp_path, "mixtral", seed=1, **overrides))
    monkeypatch.setattr(backends, "cuda_status", lambda: (True, "NVIDIA H200 found"))
    stub = ModuleType("expert_service.cuda.decoder")
    stub.CudaDecoder = lambda *args: pytest.fail("the decoder is never built for a model it cannot route")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "expert_service.cuda.decoder", stub)
    with pytest.raises(ConfigError) as err:
        build_engine(model, EngineConfig(backend="cuda", kv_cache_tokens=256, expert_cache_slots=slots))
    message = str(err.value)
    assert "\n" not in message and message.startswith("backend: ")
    assert f"this model has {experts} experts a layer, {top_k} a token" in message


def test_the_start_up_limits_are_the_kernels_own():
    """The limits the worker checks without numba are the routing kernels' shared-memory sizes, and the device slot
    map holds at least as many experts and slots a layer (so it needs no start-up check of its own)."""
    from expert_service.experts.slot_map_reference import MAX_EXPERTS, MAX_SLOTS
    from expert_service.kernels import expert_grouping, gate_fused, gate_topk, moe_align

    assert {m.MAX_E for m in (gate_topk, gate_fused, expert_grouping, moe_align)} == {backends.CUDA_MAX_EXPERTS}
    assert {gate_topk.MAX_K, gate_fused.MAX_K} == {backends.CUDA_MAX_TOP_K}
    assert backends.CUDA_MAX_EXPERTS <= min(MAX_EXPERTS, MAX_SLOTS)
