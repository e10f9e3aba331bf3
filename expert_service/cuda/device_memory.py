"""The device memory a cuda engine plans, checked against what the GPU has free before anything is allocated.

`check_device_memory` adds up what CudaDecoder will allocate -- the dense weights (dense.bin), the resident experts
or the expert cache's slots, the two KV pools and the workspace (laid out on the host by `plan_workspace`: the
layout the decoder then allocates) -- and refuses, in one line naming the settings to lower, a plan larger
than the device's free memory. What the CUDA runtime takes beside the plan (kernel modules, cuBLAS's handle, CUDA
graphs, the small buffers of the expert cache) is left out, so only a clear misfit is refused; the context is made
before free memory is read. An out-of-memory error while the engine loads or warms up anyway becomes the same kind
of line (`out_of_memory_as_error`), with the plan and the memory free before the load; other errors keep theirs.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np
from cuda.bindings import driver as drv
from numba import cuda

from common.errors import ColibriError, ConfigError
from common.model_config import ModelConfig
from common.model_format import ModelDir
from common.model_manifest import DENSE_FILE
from expert_service.cuda.attention_8bit import DeviceAttention8Bit, widens
from expert_service.cuda.cublas import CublasError
from expert_service.cuda.linear_8bit import EightBitRows, takes_mma
from expert_service.cuda.moe_cached import dense_scratch_needed
from expert_service.cuda.moe_strategy import ModelStrategies
from expert_service.cuda.penalties import DevicePenalties
from expert_service.cuda.shared_prefix import shared_members
from expert_service.cuda.token_masks import DeviceMasks
from expert_service.cuda.weights import ExpertFacts, expert_facts
from expert_service.cuda.workspace import layout_workspace
from expert_service.engine.config import EngineConfig, RoutingMode
from expert_service.experts.slots import SlotPlan

log = logging.getLogger("colibri.worker.cuda")
GIB = 2**30
OUT_OF_MEMORY = drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY
CUBLAS_STATUS_ALLOC_FAILED = 3
F = TypeVar("F", bound=Callable[..., Any])


def gib(num_bytes: int) -> str:
    """Bytes in GiB, one decimal (two significant digits below 0.1, so a small item does not read 0.0)."""
    value = num_bytes / GIB
    return f"{value:.1f}" if value >= 0.1 or value == 0 else f"{value:.2g}"


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """The device's name and its free and total memory in bytes, as the driver reports them."""

    name: str
    free: int
    total: int

    def describe(self, verb: str = "has") -> str:
        return f"{self.name} {verb} {gib(self.free)} of {gib(self.total)} GiB free"


def free_pending_deallocations() -> None:
    """Numba frees device arrays lazily: what an engine dropped earlier in this process (benchmarks, tests) still
    holds is freed now, so the free memory read next counts it."""
    gc.collect()
    manager = getattr(cuda.current_context(), "memory_manager", None)
    pending = getattr(manager, "deallocations", None)  # an EMM plugin may keep none
    if pending is not None:
        pending.clear()


def read_device_memory() -> DeviceMemory:
    """The current device's memory (its context is made first, so what it holds is no longer free)."""
    context = cuda.current_context()
    free, total = context.get_memory_info()
    name = context.device.name  # str in numba-cuda 0.30, bytes in older releases
    return DeviceMemory(name.decode(errors="replace") if isinstance(name, bytes) else str(name), int(free), int(total))


def kv_pool_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
    """The shape of each of the two KV pools (K and V): [layers, blocks, block_size, kv heads, head_dim]."""
    return (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)


def blocks_per_sequence(config: ModelConfig, num_blocks: int, block_size: int) -> int:
    """A block table's row: the blocks of one sequence's longest context (the model's, or the whole pool)."""
    return -(-min(config.max_position_embeddings, num_blocks * block_size) // block_size)


@dataclass(frozen=True, slots=True)
class WorkspacePlan:
    """The workspace an engine lays out and the bounds it was laid out for (CudaDecoder.set_options checks other
    options against them)."""

    layout: dict[str, tuple[tuple[int, ...], np.dtype]]
    cached_grouped: int  # the largest cached step in grouped waves (moe_strategy.cached_grouped_tokens)
    w8a8_min_rows: int  # the rows an expert from which W8A8 steps quantise their activations (0: never)
    shared_members: int  # the sequences a group of attention_decode_shared holds (0: no shared prefixes)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in self.layout.values())


def plan_workspace(
    strategies: ModelStrategies, config: EngineConfig, kv_dtype, max_blocks_per_seq: int, cached: bool
) -> WorkspacePlan:
    """workspace.layout_workspace for an engine of this model (its strategy bounds), config and KV pool."""
    cfg, options = strategies.config, config.cuda_options
    cached_grouped = strategies.cached_grouped(options)
    w8a8_min_rows = strategies.w8a8_min_rows(options)
    members = shared_members(cfg, kv_dtype, config.kv_block_size, options)
    layout = layout_workspace(
        cfg,
        strategies.weights.dtype,
        strategies.max_tokens,
        config.max_batch_size,
        max_blocks_per_seq,
        len(cfg.moe_layers),
        cached=cached,
        planned=config.routing is RoutingMode.LUT,
        quantized=strategies.weights.quantized,
        q8_mma=strategies.q8_mma(options),
        cached_mma=options.cached_mma,
        cached_grouped=cached_grouped,
        few_expert_mma=strategies.few_expert_mma(options),
        w8a8_min_rows=w8a8_min_rows,
        shared_members=members,
    )
    return WorkspacePlan(layout, cached_grouped, w8a8_min_rows, members)


@dataclass(frozen=True, slots=True)
class PlanItem:
    name: str
    nbytes: int
    settings: str = ""  # the settings that size it, as the worker's config spells them
    remedy: str = ""  # how to make it smaller ("": a setting cannot)


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """What an engine will allocate, item by item, beside the device memory measured before it does; and the
    workspace layout it allocates."""

    items: tuple[PlanItem, ...]
    memory: DeviceMemory
    workspace: WorkspacePlan
    facts: ExpertFacts  # read off the model directory once: the weights' upload takes them from here

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)

    def describe(self) -> str:
        parts = ", ".join(
            f"{item.name} {gib(item.nbytes)}" + (f" ({item.settings})" if item.settings else "")
            for item in self.items
            if item.nbytes
        )
        return f"the plan needs {gib(self.nbytes)} GiB ({parts})"

    @property
    def remedy(self) -> str:
        """What to lower, the largest item first (the dense weights: no setting shrinks them)."""
        if sum(item.nbytes for item in self.items if not item.remedy) > self.memory.free:
            return (
                "the dense weights alone need more than is free: stop other processes on the GPU, or use a larger one"
            )
        clauses = [item.remedy for item in sorted(self.items, key=lambda i: -i.nbytes) if item.remedy and item.nbytes]
        return "largest first: " + ", ".join(clauses[:-1]) + (" or " if len(clauses) > 1 else "") + clauses[-1]

    def misfit_error(self) -> ConfigError:
        return ConfigError(f"device out of memory: {self.describe()} and {self.memory.describe()}; {self.remedy}")

    def out_of_memory_error(self, error: BaseException, stage: str) -> ConfigError:
        return ConfigError(
            f"device out of memory while {stage} ({_cause(error)}): {self.describe()} and "
            f"{self.memory.describe('had')} before the load; what the plan leaves out (kernel modules, cuBLAS, CUDA "
            f"graphs, fragmentation) took the rest; {self.remedy}"
        )


def plan_device_memory(
    model: ModelDir, config: EngineConfig, slot_plan: SlotPlan, memory: DeviceMemory, plan_table_bytes: int = 0
) -> DevicePlan:
    """The plan of a CudaDecoder of this model, config and slot plan, from the model directory alone.
    plan_table_bytes: the expert cache's plan-prefetch table, uploaded with its slots."""
    cfg, cached = model.config, slot_plan.is_cached
    T, S, V = config.max_batch_tokens, config.max_batch_size, cfg.vocab_size
    facts = expert_facts(model, resident=not cached)
    num_blocks, block_size = config.resolved_num_kv_blocks, config.kv_block_size
    kv = 2 * math.prod(kv_pool_shape(cfg, num_blocks, block_size)) * facts.dtype.itemsize  # K and V
    kv_item = PlanItem("KV cache", kv, f"kv_cache_tokens {config.kv_cache_tokens}", "lower kv_cache_tokens")
    if config.num_kv_blocks:  # it wins over kv_cache_tokens
        kv_item = PlanItem(
            "KV cache", kv, f"num_kv_blocks {config.num_kv_blocks} of {block_size} tokens", "lower num_kv_blocks"
        )
    workspace = plan_workspace(
        ModelStrategies(cfg, facts, T), config, facts.dtype, blocks_per_sequence(cfg, num_blocks, block_size), cached
    )
    # the penalties' and grammar masks' buffers are allocated beside the workspace, sized like it; so are the
    # launch tables and bf16 rows of an 8-bit head and of 8-bit attention projections (and the latter's widening
    # scratch)
    sampling = DevicePenalties.planned_nbytes(S, V, S, T) + DeviceMasks.planned_nbytes(S, V)
    if (head := model.head_format) is not None:
        sampling += EightBitRows.planned_nbytes(S, cfg.hidden_size, takes_mma(V, head.nbytes))
    widening = False  # 8-bit attention widened for cuBLAS: a scratch the remedy names
    if model.attention_format is not None:
        dense_rows = config.cuda_options.attention_8bit_dense_rows
        widening = widens(dense_rows, T)
        sampling += DeviceAttention8Bit.planned_nbytes(cfg.hidden_size, cfg.q_size, T, facts.dtype, dense_rows)
    if cached:
        experts = slot_plan.slots_per_layer * slot_plan.slot_row_bytes + plan_table_bytes
        if dense_scratch_needed(facts.quantized, T, workspace.cached_grouped):  # one 8-bit expert made dense
            experts += 3 * cfg.moe_intermediate_size * cfg.hidden_size * facts.dtype.itemsize
        budget = "expert_cache_slots" if config.expert_cache_slots else "expert_cache_gb"
        value = config.expert_cache_slots if config.expert_cache_slots else f"{config.expert_cache_gb:g}"
        slots = f"{budget} {value}: {slot_plan.slots_per_layer} of {cfg.num_experts} experts a layer"
        expert_item = PlanItem("expert slots", experts, slots, f"lower {budget}")
    else:
        experts = cfg.num_experts * sum(model.expert_strides[layer] for layer in cfg.moe_layers)
        remedy = f"set expert_cache_gb below {gib(experts)} (an expert cache: the rest stays on the host)"
        expert_item = PlanItem("experts", experts, "every expert resident", remedy)
    items = (
        PlanItem("dense weights", os.path.getsize(model.path / DENSE_FILE)),
        expert_item,
        kv_item,
        PlanItem(
            "workspace",
            workspace.nbytes + sampling,
            f"max_batch_tokens {T}, max_batch_size {S}",
            "lower max_batch_tokens / max_batch_size"
            + (" (or cuda_options attention_8bit_dense_rows 0: no widening scratch)" if widening else ""),
        ),
    )
    return DevicePlan(items, memory, workspace, facts)


def check_device_memory(
    model: ModelDir, config: EngineConfig, slot_plan: SlotPlan, plan_table_bytes: int = 0
) -> DevicePlan:
    """Reads the device's memory and plans the engine (both logged); a plan larger than the free memory is refused
    with a one-line ConfigError. Called before the engine allocates anything."""
    try:
        free_pending_deallocations()
        memory = read_device_memory()
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        raise ConfigError(
            f"device out of memory: no CUDA context could be made ({_cause(e)}); another process holds the GPU's "
            f"memory (nvidia-smi lists them)"
        ) from e
    plan = plan_device_memory(model, config, slot_plan, memory, plan_table_bytes)
    log.info(
        "device memory: %s before the load; %s",
        memory.describe(),
        plan.describe(),
        extra={"free_bytes": memory.free, "total_bytes": memory.total, "plan_bytes": plan.nbytes},
    )
    if plan.nbytes > memory.free:
        raise plan.misfit_error()
    return plan


def is_out_of_memory(error: BaseException | None) -> bool:
    """Whether `error`, or one it was raised from, says the device is out of memory: numba-cuda's CudaAPIError and
    driver.CudaDriverError by their CUresult, cuBLAS by its status, others (cuda.core's) by the driver's name for it."""
    while error is not None and not isinstance(error, ColibriError):
        code = getattr(error, "code", None)
        if isinstance(code, drv.CUresult) and code == OUT_OF_MEMORY:
            return True
        if isinstance(error, CublasError) and error.status == CUBLAS_STATUS_ALLOC_FAILED:
            return True
        if OUT_OF_MEMORY.name in str(error):
            return True
        error = error.__cause__
    return False


def _cause(error: BaseException) -> str:
    """The error in a few words on one line (numba's CudaAPIError: "Call to cuMemAlloc results in ...")."""
    msg = getattr(error, "msg", None)
    text = msg if isinstance(msg, str) else f"{type(error).__name__}: {error}"
    return " ".join(text.split())[:200]


def out_of_memory_as_error(stage: str) -> Callable[[F], F]:
    """For a method of an object that sets `device_plan` (check_device_memory's) before it allocates: a device
    out-of-memory error it raises becomes the plan's one-line ConfigError, "while <stage>", the original its
    cause; any other error, or one raised before the plan was made, passes unchanged. Once it returns, the device's
    free memory is logged."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            try:
                result = method(self, *args, **kwargs)
            except Exception as e:
                plan = getattr(self, "device_plan", None)
                if plan is None or not is_out_of_memory(e):
                    raise
                raise plan.out_of_memory_error(e, stage) from e
            if getattr(self, "device_plan", None) is not None:
                memory = read_device_memory()
                log.info(
                    "device memory after %s: %s",
                    stage,
                    memory.describe(),
                    extra={"free_bytes": memory.free, "total_bytes": memory.total},
                )
            return result

        return cast(F, guarded)

    return decorate
