"""Which compute backend runs the engine, and building the two together. Each backend is imported only when
chosen, so the cpu backend never loads numba.cuda."""

from __future__ import annotations

import logging

from common.errors import ConfigError
from common.model_format import ModelDir
from expert_service.engine.config import Backend, EngineConfig
from expert_service.engine.engine import Engine
from expert_service.engine.step import Decoder
from expert_service.experts.cache import DEVICE_POLICIES
from expert_service.experts.routing_plan import warn_unread_plan_table
from expert_service.experts.slots import SlotPlan, plan_slots

log = logging.getLogger("colibri.worker")
# The cuda backend's routing kernels (gate top-k, the fused gate, the expert grouping and alignment) keep a token's
# expert scores and a layer's expert counts in fixed-size shared-memory arrays: these are their sizes, here so the
# worker refuses a model beyond them at start-up without importing numba (a test holds them equal to the kernels').
CUDA_MAX_EXPERTS = 256
CUDA_MAX_TOP_K = 8


def cuda_status() -> tuple[bool, str]:
    """Whether a usable NVIDIA GPU and driver are present (never in the simulator), and why, in a few words."""
    try:
        from numba import cuda
        from numba.cuda import config
    except Exception:  # no numba-cuda, broken install: the CPU backend still works
        return False, "numba-cuda is not installed (the cuda extra)"
    if config.ENABLE_CUDASIM:  # type: ignore[attr-defined]  # set from the environment at import: no stub has it
        return False, "NUMBA_ENABLE_CUDASIM=1 is set"
    try:
        if not cuda.is_available():
            return False, "no usable NVIDIA GPU or driver was found"
        name = cuda.get_current_device().name  # str in numba-cuda 0.30, bytes in older releases
        return True, f"{name.decode(errors='replace') if isinstance(name, bytes) else name} found"
    except Exception as exc:  # a driver that fails to initialise
        return False, f"the CUDA driver failed to start ({type(exc).__name__})"


def cuda_available() -> bool:
    """A usable NVIDIA GPU and driver (never true in the simulator)."""
    return cuda_status()[0]


def resolve_backend(requested: Backend) -> tuple[Backend, str]:
    """The backend to run and why: `auto` is cuda when a usable GPU is present, else cpu."""
    if requested is not Backend.AUTO:
        return requested, f"--backend {requested.value}"
    usable, why = cuda_status()
    return (Backend.CUDA if usable else Backend.CPU), f"auto: {why}"


def make_decoder(model: ModelDir, config: EngineConfig, slot_plan: SlotPlan) -> Decoder:
    """The chosen backend's decoder."""
    backend, why = resolve_backend(config.backend)
    log.info("backend %s (%s)", backend.value, why, extra={"backend": backend.value, "reason": why})
    if backend is Backend.CUDA:
        usable, status = cuda_status()
        if not usable:
            raise ConfigError(f"backend: cuda was asked for but {status} (use --backend cpu or auto)")
        if slot_plan.is_cached and config.expert_cache_policy not in DEVICE_POLICIES:
            raise ConfigError(
                f"expert_cache_policy: {config.expert_cache_policy!r} runs on the cpu backend only; the cuda "
                f"backend's cache implements {', '.join(DEVICE_POLICIES)}"
            )
        _check_cuda_routing(model)
        from expert_service.cuda.decoder import CudaDecoder

        return CudaDecoder(model, config, slot_plan)
    from expert_service.cpu.decoder import CpuDecoder

    return CpuDecoder(model, config, slot_plan)


def _check_cuda_routing(model: ModelDir) -> None:
    """A model beyond the cuda routing kernels' fixed sizes is refused here, in one line and before any GPU memory
    is taken (the kernels' own checks raised a ValueError traceback at the first step). The device slot map holds
    more experts and slots a layer than these kernels route (a test holds that), so it needs no check of its own."""
    experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    if experts > CUDA_MAX_EXPERTS or top_k > CUDA_MAX_TOP_K:
        raise ConfigError(
            f"backend: the cuda backend routes at most {CUDA_MAX_EXPERTS} experts a MoE layer, {CUDA_MAX_TOP_K} a "
            f"token, and this model has {experts} experts a layer, {top_k} a token; use --backend cpu"
        )


def build_engine(model: ModelDir, config: EngineConfig = EngineConfig(), slot_plan: SlotPlan | None = None) -> Engine:
    """An engine over the backend `config.backend` resolves to, with the expert slots its budget allows.
    `slot_plan`: plan_slots of this model and config when the caller has it already (the worker plans them before
    it binds its ports); None plans them here."""
    if slot_plan is None:
        slot_plan = plan_slots(model, config.expert_cache_gb, config.expert_cache_slots)
    log.info(slot_plan.describe())
    warn_unread_plan_table(config, slot_plan.is_cached)
    return Engine(model, config, make_decoder(model, config, slot_plan))
