"""The model configuration every component shares, built once from a Hugging Face ``config.json``.

Each family module in ``common.models`` reads its family's HF keys and returns a ``ModelConfig``; the
variants between families (biases, q/k norms, shared expert, dense layers, routing normalisation) are
plain fields here, so the decoder in ``expert_service`` is one piece of code driven by this record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import numpy as np

from common.errors import ConfigError

MAX_VOCAB = 1 << 24  # token ids travel as uint32; embeddings this size are already ~100 GB
MAX_CONTEXT = 1 << 24  # positions per sequence: beyond any KV pool a GPU holds
DEFAULT_ROPE_THETA = 10000.0  # transformers' base default, where a family's config class names none


class QKNorm(str, Enum):
    NONE = "none"
    PER_HEAD = "per_head"  # Qwen3-MoE: RMSNorm over head_dim, weight [head_dim]
    FULL = "full"  # OLMoE: RMSNorm over the whole projection, weight [heads * head_dim]


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3 / yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: scales cos/sin; None = derived from factor (and mscale)
    mscale: float | None = None  # yarn: with mscale_all_dim, the derived attention factor's numerator
    mscale_all_dim: float | None = None  # yarn: ... and its denominator
    truncate: bool = True  # yarn

    SUPPORTED = ("default", "linear", "llama3", "yarn")

    @classmethod
    def from_hf(cls, hf: dict) -> RopeConfig:
        # transformers 5 writes `rope_parameters`; hub checkpoints carry `rope_theta` + `rope_scaling`.
        for key in ("rope_parameters", "rope_scaling"):
            if hf.get(key) is not None and not isinstance(hf[key], dict):
                raise ConfigError(f"config.json: {key} must be an object, got {hf[key]!r}")
        params = dict(hf.get("rope_parameters") or {})
        if "rope_theta" not in params:
            params["rope_theta"] = hf.get("rope_theta", DEFAULT_ROPE_THETA)
        scaling = hf.get("rope_scaling") or {}
        params.update({k: v for k, v in scaling.items() if v is not None})
        # transformers lets a top-level original_max_position_embeddings (Phi-3's spelling) win over the entry's
        if hf.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in cls.SUPPORTED:
            raise ConfigError(
                f"config.json: rope type {rope_type!r} is not supported (supported: {', '.join(cls.SUPPORTED)})"
            )

        def get(key: str, default, kind: str = "number"):
            value = params.get(key)
            if value is None:
                return default
            # float("8") would read a quoted value and bool("false") misread one: refuse both
            if kind == "bool":
                ok = isinstance(value, bool)
            else:
                ok = not isinstance(value, bool) and isinstance(value, int if kind == "integer" else (int, float))
                ok = ok and math.isfinite(value)
            if not ok:
                what = {"bool": "true or false", "integer": "an integer", "number": "a finite number"}[kind]
                raise ConfigError(f"config.json: rope setting {key} must be {what}, got {value!r}")
            return value

        return cls(
            theta=float(get("rope_theta", DEFAULT_ROPE_THETA)),
            rope_type=rope_type,
            factor=float(get("factor", 1.0)),
            low_freq_factor=float(get("low_freq_factor", 1.0)),
            high_freq_factor=float(get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                get("original_max_position_embeddings", hf.get("max_position_embeddings", 0), "integer")
            ),
            # transformers reads `beta_fast or 32`: a 0 takes the default (and would divide by zero here)
            beta_fast=float(get("beta_fast", 32.0) or 32.0),
            beta_slow=float(get("beta_slow", 1.0) or 1.0),
            attention_factor=get("attention_factor", None),
            mscale=get("mscale", None),
            mscale_all_dim=get("mscale_all_dim", None),
            truncate=get("truncate", True, "bool"),
        )

    def inverse_frequencies(self, head_dim: int) -> tuple[np.ndarray, float]:
        """Returns (inv_freq [head_dim/2] float32, cos/sin scale), following transformers' rope utils."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        pos_freqs = np.float32(self.theta) ** exponents
        inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
        if self.rope_type == "default":
            return inv_freq, 1.0
        if self.rope_type == "linear":
            return (inv_freq / np.float32(self.factor)).astype(np.float32), 1.0
        if self.rope_type == "llama3":
            return self._llama3(inv_freq), 1.0
        return self._yarn(pos_freqs, head_dim)

    def _llama3(self, inv_freq: np.ndarray) -> np.ndarray:
        old_len = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old_len / self.low_freq_factor, old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)

    def _yarn(self, pos_freqs: np.ndarray, dim: int) -> tuple[np.ndarray, float]:
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.attention_factor is not None:
            attention_factor = self.attention_factor
        elif self.mscale and self.mscale_all_dim:  # transformers: both set and non-zero, else factor alone
            attention_factor = mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        else:
            attention_factor = mscale(self.factor)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp
        inv_extra = 1.0 / pos_freqs
        inv_inter = 1.0 / (self.factor * pos_freqs)
        inv_freq = inv_inter * (1 - extrapolation_factor) + inv_extra * extrapolation_factor
        return inv_freq.astype(np.float32), float(attention_factor)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Sizes and variants of one MoE decoder. Field names follow HF where HF has one name for it."""

    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool  # biases on q/k/v projections
    o_bias: bool  # bias on the output projection
    qk_norm: QKNorm
    clip_qkv: float | None  # OLMoE: clamp q, k, v to [-clip, clip] after the projections
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    intermediate_size: int  # FFN size of dense (non-MoE) layers
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False)
    shared_expert_intermediate_size: int  # 0 = no shared expert (Qwen2-MoE has one, with a sigmoid gate)
    sliding_windows: tuple[int | None, ...]  # per layer: attend to the last N positions, None = full
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def __post_init__(self):
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "max_position_embeddings",
        )
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"config.json: {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"config.json: num_experts_per_tok must be in [1, num_experts="
                f"{self.num_experts}], got {self.num_experts_per_tok}"
            )
        if len(self.sparse_layers) != self.num_hidden_layers or len(self.sliding_windows) != self.num_hidden_layers:
            raise ConfigError("config.json: per-layer settings do not match num_hidden_layers")
        if self.num_experts > 65535:
            raise ConfigError(f"config.json: num_experts {self.num_experts} exceeds 65535")
        if self.head_dim % 2:
            raise ConfigError(
                f"config.json: head_dim must be even (rotary embeddings pair its halves), got {self.head_dim}"
            )
        if not (math.isfinite(self.rms_norm_eps) and 0 < self.rms_norm_eps < 1):
            raise ConfigError(f"config.json: rms_norm_eps must be in (0, 1), got {self.rms_norm_eps}")
        for window in self.sliding_windows:
            if window is not None and not 0 < window <= MAX_CONTEXT:
                raise ConfigError(f"config.json: sliding_window must be in [1, {MAX_CONTEXT}], got {window}")
        for name, ids in (
            ("eos_token_id", self.eos_token_ids),
            ("bos_token_id", () if self.bos_token_id is None else (self.bos_token_id,)),
        ):
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise ConfigError(f"config.json: {name} {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if self.clip_qkv is not None and not (math.isfinite(self.clip_qkv) and self.clip_qkv > 0):
            raise ConfigError(f"config.json: clip_qkv must be a finite number > 0, got {self.clip_qkv}")
        rope = self.rope
        if not all(math.isfinite(v) and v > 0 for v in (rope.theta, rope.factor)):
            raise ConfigError(
                f"config.json: rope theta and factor must be finite and > 0, got {rope.theta}, {rope.factor}"
            )
        # llama3 divides by high - low and by the original length, yarn takes its log: NaN or a crash at load
        if rope.rope_type in ("llama3", "yarn") and rope.original_max_position_embeddings <= 0:
            raise ConfigError(
                f"config.json: rope type {rope.rope_type} needs original_max_position_embeddings > 0, "
                f"got {rope.original_max_position_embeddings}"
            )
        # yarn's derived attention factor divides by 0.1 * mscale_all_dim * log(factor) + 1
        if rope.rope_type == "yarn" and any(m is not None and m < 0 for m in (rope.mscale, rope.mscale_all_dim)):
            raise ConfigError(
                "config.json: rope yarn needs mscale and mscale_all_dim >= 0, "
                f"got {rope.mscale} and {rope.mscale_all_dim}"
            )
        if rope.rope_type == "llama3" and not 0 < rope.low_freq_factor < rope.high_freq_factor:
            raise ConfigError(
                f"config.json: rope llama3 needs 0 < low_freq_factor < high_freq_factor, got "
                f"{rope.low_freq_factor} and {rope.high_freq_factor}"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, sparse in enumerate(self.sparse_layers) if sparse]
