"""Worker-side configuration (see common/config.py for how sources are layered)."""
from __future__ import annotations

from dataclasses import dataclass

from common.config import setting
from common.errors import ConfigError

BACKENDS = ("auto", "cpu", "cuda")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    backend: str = setting("auto", "compute backend: auto (cuda when a GPU is present), cuda or cpu",
                           env=("COLIBRI_BACKEND",))
    kv_block_size: int = setting(16, "tokens per KV-cache block", env=("COLIBRI_KV_BLOCK_SIZE",))
    num_kv_blocks: int = setting(0, "KV-cache blocks in the pool; 0 = derive from --kv-cache-tokens",
                                 env=("COLIBRI_NUM_KV_BLOCKS",))
    kv_cache_tokens: int = setting(65536, "KV-cache capacity in tokens when --num-kv-blocks is 0",
                                   env=("COLIBRI_KV_CACHE_TOKENS",))
    max_batch_tokens: int = setting(8192, "largest number of tokens in one step",
                                    env=("COLIBRI_MAX_BATCH_TOKENS", "MAX_BATCH_TOKENS"))
    max_batch_size: int = setting(64, "largest number of sequences in one step",
                                  env=("COLIBRI_MAX_BATCH_SIZE", "MAX_BATCH_SIZE"))
    cuda_graphs: bool = setting(True, "replay decode steps as CUDA graphs, one per batch-size bucket (false: "
                                "launch every kernel eagerly, for debugging)", env=("COLIBRI_CUDA_GRAPHS",))
    use_pinned_memory: bool = setting(True, "page-lock the model mmaps for fast host-to-device copies (false: "
                                      "copy through a pinned bounce buffer, for comparison)",
                                      env=("COLIBRI_USE_PINNED_MEMORY",))
    routing: str = setting("exact", "expert routing: exact (the model's gate, default) or lut (the router's static "
                           "table, an approximation: responses are labelled)", env=("COLIBRI_ROUTING",))
    verify_checksums: bool = setting(True, "verify every tensor's crc32 when loading (false skips it)",
                                     env=("COLIBRI_VERIFY_CHECKSUMS",))

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for name in ("kv_block_size", "kv_cache_tokens", "max_batch_tokens", "max_batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.routing not in ("exact", "lut"):
            raise ConfigError(f"routing: must be exact or lut, got {self.routing!r}")
        if self.num_kv_blocks < 0:
            raise ConfigError(f"num_kv_blocks: must be >= 0, got {self.num_kv_blocks}")

    @property
    def resolved_num_kv_blocks(self) -> int:
        return self.num_kv_blocks or -(-self.kv_cache_tokens // self.kv_block_size)
