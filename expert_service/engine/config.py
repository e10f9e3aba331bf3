"""Worker-side configuration (see common/config.py for how sources are layered)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum

from common.config import coerce_value, setting
from common.errors import ConfigError
from expert_service.engine.cuda_options import CudaOptions
from expert_service.experts.cache import POLICIES

# The largest budget: its bytes (int(gb * 2^30)) stay below 2^63, so they fit Info's uint64 budget_bytes (1e300 GiB
# overflowed to an infinite float, 1e11 GiB answered Info with "Value out of range").
MAX_EXPERT_CACHE_GB = 2.0**33


class Backend(StrEnum):
    AUTO = "auto"  # cuda when a usable GPU is present, else cpu
    CPU = "cpu"
    CUDA = "cuda"


class RoutingMode(StrEnum):
    EXACT = "exact"  # the model's own gate (default)
    LUT = "lut"  # the router's static token -> experts table: an approximation, labelled in outputs


class PrefetchSource(StrEnum):
    PLAN = "plan"  # the router's routing plan for the step
    LOOKAHEAD = "lookahead"  # layer L+1's gate applied to layer L's input


@dataclass(frozen=True, slots=True)
class EngineConfig:
    backend: Backend = setting(
        Backend.AUTO, "compute backend: auto (cuda when a GPU is present), cuda or cpu", env=("COLIBRI_BACKEND",)
    )
    kv_block_size: int = setting(16, "tokens per KV-cache block", env=("COLIBRI_KV_BLOCK_SIZE",))
    num_kv_blocks: int = setting(
        0, "KV-cache blocks in the pool; 0 = derive from --kv-cache-tokens", env=("COLIBRI_NUM_KV_BLOCKS",)
    )
    kv_cache_tokens: int = setting(
        65536, "KV-cache capacity in tokens when --num-kv-blocks is 0", env=("COLIBRI_KV_CACHE_TOKENS",)
    )
    max_batch_tokens: int = setting(
        8192, "largest number of tokens in one step", env=("COLIBRI_MAX_BATCH_TOKENS", "MAX_BATCH_TOKENS")
    )
    max_batch_size: int = setting(
        64, "largest number of sequences in one step", env=("COLIBRI_MAX_BATCH_SIZE", "MAX_BATCH_SIZE")
    )
    cuda_graphs: bool = setting(
        True,
        "replay steps as CUDA graphs: decode steps one per batch-size bucket, other "
        "steps one per token bucket (in pieces around the host step of per-expert cuBLAS "
        "GEMMs; with the expert cache too) (false: "
        "launch every kernel eagerly, for debugging; steps are padded the same way)",
        env=("COLIBRI_CUDA_GRAPHS",),
    )
    use_pinned_memory: bool = setting(
        True,
        "page-lock the model mmaps for fast host-to-device copies (false: "
        "copy through a pinned bounce buffer, for comparison)",
        env=("COLIBRI_USE_PINNED_MEMORY",),
    )
    routing: RoutingMode = setting(
        RoutingMode.EXACT,
        "expert routing: exact (the model's gate, default) or lut (the router's static "
        "table, an approximation: responses are labelled)",
        env=("COLIBRI_ROUTING",),
    )
    verify_checksums: bool = setting(
        True, "verify every tensor's crc32 when loading (false skips it)", env=("COLIBRI_VERIFY_CHECKSUMS",)
    )
    expert_cache_gb: float = setting(
        0.0,
        "GiB of expert slots (stored bytes); 0 = every expert resident. Below "
        "the experts' total, each MoE layer gets floor(budget / sum of the MoE layers' "
        "expert strides) slots caching the host copy; a budget below one slot is refused",
        env=("COLIBRI_EXPERT_CACHE_GB",),
    )
    expert_cache_slots: int = setting(
        0,
        "expert slots per MoE layer, at most the model's experts (wins over --expert-cache-gb, but must fit a "
        "budget given with it; 0 = from the budget)",
        env=("COLIBRI_EXPERT_CACHE_SLOTS",),
    )
    expert_cache_policy: str = setting(
        "lru",
        "expert cache replacement policy: lru, or lfu (least frequently used, with aging)",
        env=("COLIBRI_EXPERT_CACHE_POLICY",),
    )
    prefetch: str = setting(
        "plan",
        "expert prefetch sources when the expert cache runs: none, plan (the "
        "routing table's prediction for the step's tokens: see --plan-table), lookahead (layer L+1's gate on "
        "layer L's input) or both, "
        "comma-separated",
        env=("COLIBRI_PREFETCH",),
    )
    prefetch_large_steps: bool = setting(
        False,
        "also prefetch in steps whose tokens may route to more experts than a layer has slots (tokens x top-k > "
        "slots: prefill chunks, large batches), where demand copies already fill the link and a prediction "
        "evicts experts the step itself needs (false: such steps copy only their misses)",
        env=("COLIBRI_PREFETCH_LARGE_STEPS",),
    )
    plan_table: str = setting(
        "",
        "routing table the expert cache's plan prefetch looks each step's own tokens up in (on the device on "
        "cuda: no plan from the router needed, and right for steps launched before the one ahead is collected): a "
        "file; empty = the model directory's routing_table.bin when it has one, else the router's plans; "
        "'router' = always the router's plans",
        env=("COLIBRI_PLAN_TABLE",),
    )
    # the cuda backend's alternative kernel paths (no flag: for benchmarks and tests; a config file may give
    # a mapping of CudaOptions fields)
    cuda_options: CudaOptions = field(default_factory=CudaOptions)

    def __post_init__(self):
        if isinstance(self.cuda_options, Mapping):
            object.__setattr__(self, "cuda_options", cuda_options_from_mapping(self.cuda_options))
        elif not isinstance(self.cuda_options, CudaOptions):
            raise ConfigError(f"cuda_options: must be a mapping of CudaOptions fields, got {self.cuda_options!r}")
        for name, kind in (("backend", Backend), ("routing", RoutingMode)):  # plain strings from code
            try:
                object.__setattr__(self, name, kind(getattr(self, name)))
            except ValueError:
                raise ConfigError(f"{name}: must be one of {', '.join(kind)}, got {getattr(self, name)!r}") from None
        for name in ("kv_block_size", "kv_cache_tokens", "max_batch_tokens", "max_batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.num_kv_blocks < 0:
            raise ConfigError(f"num_kv_blocks: must be >= 0, got {self.num_kv_blocks}")
        if not 0 <= self.expert_cache_gb < math.inf:  # NaN fails too (a budget becomes int(budget * GIB) bytes)
            raise ConfigError(f"expert_cache_gb: must be a finite number >= 0, got {self.expert_cache_gb}")
        if self.expert_cache_gb >= MAX_EXPERT_CACHE_GB:  # its bytes overflow a float, or Info's uint64 budget_bytes
            raise ConfigError(
                f"expert_cache_gb: must be below 2^33 GiB (8 EiB, far beyond any host), got {self.expert_cache_gb:g}"
            )
        if self.expert_cache_slots < 0:
            raise ConfigError(f"expert_cache_slots: must be >= 0, got {self.expert_cache_slots}")
        # read like the enum settings (--backend CUDA, --routing LUT): case and surrounding blanks don't matter
        for name in ("expert_cache_policy", "prefetch"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, getattr(self, name).strip().lower())
        if self.expert_cache_policy not in POLICIES:
            raise ConfigError(
                f"expert_cache_policy: must be one of {', '.join(POLICIES)}, got {self.expert_cache_policy!r}"
            )
        sources = [s.strip() for s in self.prefetch.split(",") if s.strip()]
        if sources != ["none"] and (not sources or any(s not in set(PrefetchSource) for s in sources)):
            raise ConfigError(f"prefetch: must be none, plan, lookahead or plan,lookahead, got {self.prefetch!r}")

    @property
    def prefetch_sources(self) -> frozenset[PrefetchSource]:
        """The enabled prefetch sources (empty: none)."""
        return frozenset(
            PrefetchSource(s.strip()) for s in self.prefetch.split(",") if s.strip() in set(PrefetchSource)
        )

    @property
    def resolved_num_kv_blocks(self) -> int:
        return self.num_kv_blocks or -(-self.kv_cache_tokens // self.kv_block_size)


def cuda_options_from_mapping(values: Mapping) -> CudaOptions:
    """CudaOptions from a config file's mapping: every key a field, every value of the field's type (a boolean
    switch, or an integer threshold)."""
    # the fields' annotations are strings (postponed evaluation): every CudaOptions field is a bool or an int
    types: dict[str, type] = {f.name: bool if f.type in (bool, "bool") else int for f in fields(CudaOptions)}
    read = {}
    for key, value in values.items():
        if key not in types:
            raise ConfigError(f"cuda_options: unknown option {key!r} (known: {', '.join(sorted(types))})")
        if isinstance(value, str):  # a YAML file's values arrive as the text written: read as a setting's text is
            value = coerce_value(value, types[key], f"cuda_options.{key}")
        elif types[key] is bool and not isinstance(value, bool):
            raise ConfigError(f"cuda_options.{key}: must be true or false, got {value!r}")
        read[key] = value  # an integer's range (and a JSON true or 2.5 for one) is CudaOptions' to refuse
    try:
        return CudaOptions(**read)
    except ValueError as err:
        raise ConfigError(str(err)) from None
