"""The MoE decoder on the cpu backend (numpy, float32): one code path for the four families, whose
differences are fields of ``ModelConfig`` (biases, q/k norms, clip_qkv, shared expert, dense layers,
sliding windows, routing normalisation). It is also the reference the CUDA backend is tested against.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from common.expert_layout import SCALE_SUFFIX
from common.model_config import ModelConfig, QKNorm
from common.model_format import ModelDir
from common.model_manifest import HEAD
from expert_service.cpu.layers.attention import paged_attention, write_kv
from expert_service.cpu.layers.moe import route, sparse_moe, swiglu_mlp
from expert_service.cpu.layers.norm import rms_norm
from expert_service.cpu.layers.rope import Rotary, apply_rotary
from expert_service.cpu.penalties import HostPenalties
from expert_service.engine.config import Backend, EngineConfig, PrefetchSource
from expert_service.engine.kv_cache import KVPool
from expert_service.engine.step import ForwardBatch, HostLogits, StepTrace
from expert_service.experts.cache import ExpertCache
from expert_service.experts.grouping import experts_by_count
from expert_service.experts.host_copy import HostCopyEngine
from expert_service.experts.routing_plan import lookup_hints, worker_plan_table
from expert_service.experts.slots import SlotPlan


def _is_scale(model: ModelDir, name: str) -> bool:
    """Whether `name` is the scale of an 8-bit matrix (the head or an attention projection) of the directory."""
    return name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in model.entries


class CpuWeights:
    """Float32 weights from a model directory: dense tensors up front, experts converted on first use."""

    def __init__(self, model: ModelDir):
        self.model = model
        self.config = model.config
        # an 8-bit head or attention projection comes dequantised (q * scale): its scale is folded in, not held
        self.dense = {
            name: model.tensor_f32(name)
            for name in model.entries
            if ".experts." not in name and not _is_scale(model, name)
        }
        self._experts: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def get(self, name: str) -> np.ndarray:
        return self.dense[name]

    def layer(self, i: int, name: str) -> np.ndarray:
        """A tensor every layer of this config has (ModelDir checked the manifest holds them all)."""
        return self.dense[f"layers.{i}.{name}"]

    def optional(self, i: int, name: str) -> np.ndarray | None:
        """A tensor only some configs have (biases): None where this one has none."""
        return self.dense.get(f"layers.{i}.{name}")

    def expert(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key = (layer, expert)
        if key not in self._experts:
            prefix = f"layers.{layer}.experts.{expert}."
            gate, up, down = (self.model.tensor_f32(prefix + p) for p in ("gate_proj", "up_proj", "down_proj"))
            self._experts[key] = (gate, up, down)
        return self._experts[key]

    @property
    def lm_head(self) -> np.ndarray:
        """lm_head when the directory holds one (untied, or an 8-bit head beside a tied embedding), else the
        embedding (tied)."""
        return self.dense[HEAD] if HEAD in self.dense else self.dense["embed_tokens"]


class CpuDecoder:
    """The numpy backend: weights in host memory, KV pool as host arrays."""

    backend = Backend.CPU
    router_plan_width = 0  # the cache prefetches every prediction of the router's plans

    def __init__(self, model: ModelDir, config: EngineConfig, slot_plan: SlotPlan, overlap: bool = False):
        # launch runs the step at once: a step launched behind another would only delay the other's answer. The
        # contract is the cuda backend's all the same (fed rows included); tests build a decoder with `overlap`
        # to run the engine's overlap logic on the host.
        self.supports_overlap = overlap
        self.w = CpuWeights(model)
        self.config: ModelConfig = model.config
        self.rotary = Rotary(self.config.rope, self.config.head_dim)
        self.kv = KVPool.allocate(
            self.config.num_hidden_layers,
            config.resolved_num_kv_blocks,
            config.kv_block_size,
            self.config.num_key_value_heads,
            self.config.head_dim,
        )
        self.slot_plan, self.prefetch = slot_plan, config.prefetch_sources
        self.prefetch_large_steps = config.prefetch_large_steps
        self.cache: ExpertCache | None = None  # None: every expert resident, no cache logic runs
        if slot_plan.is_cached:
            self.copy_engine = HostCopyEngine(model, self.config.moe_layers, slot_plan.slots_per_layer)
            self.cache = ExpertCache(
                self.config.moe_layers,
                slot_plan.num_experts,
                slot_plan.slots_per_layer,
                lambda layer, expert: model.expert_block(layer, expert)[2],  # what HostCopyEngine reads
                self.copy_engine,
                config.expert_cache_policy,
            )
        self.penalties = HostPenalties(config.max_batch_size, self.config.vocab_size)
        moe = self.config.moe_layers
        self._next_moe = {i: next((j for j in moe if j > i), None) for i in range(self.config.num_hidden_layers)}
        # the plan prefetch's own table ([L, V, k]): each step looks its tokens up, as the cuda backend does on the
        # device; None: the router's plans (batch.expert_hints)
        self.plan_lookup = worker_plan_table(model, config) if self.cache is not None else None
        self._launched: HostLogits | None = None  # the latest launched step's logits (fed rows read them)

    def memory_plan(self) -> list[tuple[str, int]]:
        """What this backend holds, in the float32 its kernels compute in. Under the expert cache the experts stay
        in the model's mmap and only the slots are held (the cuda backend's expert_weights is 0 there too)."""
        cfg = self.config
        expert_elements = len(cfg.moe_layers) * cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.hidden_size
        plan = [
            ("dense_weights", sum(a.nbytes for a in self.w.dense.values())),
            ("expert_weights", 0 if self.cache is not None else 4 * expert_elements),  # converted on first use
            ("kv_cache", self.kv.nbytes),
            ("penalties", self.penalties.nbytes),
        ]
        if self.cache is not None:  # float32 buffers on this backend (the slot plan counts stored bytes)
            plan.append(("expert_slots", self.copy_engine.nbytes))
        return plan

    def warmup(self) -> None:
        """Nothing to compile or capture on this backend."""

    def close(self) -> None:
        if self.cache is not None:
            self.copy_engine.close()

    def blocks_host(self, num_tokens: int) -> bool:
        return False

    def launch(self, batch: ForwardBatch, traced: bool = False) -> tuple[HostLogits, StepTrace | None]:
        """Runs the step at once (nothing runs ahead on the host). Rows with batch.fed_rows take the argmax of
        the step launched before, as the cuda backend reads it on the device."""
        if batch.fed_rows is not None:
            fed = batch.fed_rows >= 0
            assert self._launched is not None  # fed rows read a step launched before this one
            token_ids = batch.token_ids.copy()
            token_ids[fed] = [self._launched.greedy(int(r))[0] for r in batch.fed_rows[fed]]
            batch = replace(batch, token_ids=token_ids)
        trace = StepTrace() if traced else None
        self._launched = self.forward(batch, trace)
        return self._launched, trace

    def complete(
        self, launched: tuple[HostLogits, StepTrace | None], masks: np.ndarray
    ) -> tuple[HostLogits, StepTrace | None]:
        """Late masks: the host rows are masked as they are read, and a step launched next is fed from them."""
        logits, trace = launched
        masked = HostLogits(logits.array, logits.penalized, masks)
        if self._launched is logits:
            self._launched = masked
        return masked, trace

    def ready(self, launched) -> bool:
        return True

    def abandon(self) -> None:
        """Nothing runs ahead here."""

    def finish(self, launched: tuple[HostLogits, StepTrace | None], trace: StepTrace | None = None) -> HostLogits:
        logits, observed = launched
        if trace is not None and observed is not None:
            trace.expert_ids.update(observed.expert_ids)
            trace.expert_cache = observed.expert_cache
        return logits

    def forward(self, batch: ForwardBatch, trace: StepTrace | None = None) -> HostLogits:
        """Runs the step, writing its K/V into the pool; returns float32 logits [len(logits_rows), V]."""
        cfg, kv, cache = self.config, self.kv, self.cache
        h = self.w.get("embed_tokens")[batch.token_ids]  # [T, D]
        cos, sin = self.rotary.cos_sin(batch.positions)
        prefetching = cache is not None and self.slot_plan.step_prefetches(
            len(batch.token_ids), cfg.num_experts_per_tok, self.prefetch_large_steps
        )
        hints = self._plan_hints(batch) if prefetching else None
        if cache is not None:
            cache.begin_step()
            if cfg.moe_layers:  # the first MoE layer's plan: its copies overlap the attention before it
                self._prefetch_plan(cache, hints, cfg.moe_layers[0])
        for i in range(cfg.num_hidden_layers):
            if cache is not None:
                self._prefetch_plan(cache, hints, self._next_moe[i])
            h = h + self._attention(
                i, rms_norm(h, self.w.layer(i, "input_norm"), cfg.rms_norm_eps), batch, kv, cos, sin
            )
            planned = batch.routed_experts.get(i) if batch.routed_experts else None
            x = rms_norm(h, self.w.layer(i, "post_attn_norm"), cfg.rms_norm_eps)
            if cache is not None and prefetching:
                self._prefetch_lookahead(cache, x, self._next_moe[i])
            h = h + self._mlp(i, x, trace, planned)
        if cache is not None:
            stats = cache.end_step()
            if trace is not None:
                trace.expert_cache = stats
        h = rms_norm(h[batch.logits_rows], self.w.get("final_norm"), cfg.rms_norm_eps)
        logits = h @ self.w.lm_head.T
        penalized = self.penalties.apply(batch.penalties, logits) if batch.penalties is not None else None
        return HostLogits(logits, penalized, None if batch.masks_late else batch.token_masks)

    # --- expert cache -------------------------------------------------------------------------------
    def _plan_hints(self, batch: ForwardBatch) -> dict[int, np.ndarray] | None:
        """The step's plan, layer -> predicted ids [T, k] (-1: no prediction): its own tokens looked up in the
        table, or the router's."""
        if self.plan_lookup is None:
            return batch.expert_hints
        return lookup_hints(self.plan_lookup, batch.token_ids)

    def _prefetch_plan(self, cache: ExpertCache, hints: dict[int, np.ndarray] | None, layer: int | None) -> None:
        if layer is not None and PrefetchSource.PLAN in self.prefetch and hints and layer in hints:
            cache.prefetch(layer, experts_by_count(hints[layer]))

    def _prefetch_lookahead(self, cache: ExpertCache, x: np.ndarray, layer: int | None) -> None:
        """Layer `layer`'s gate applied to the current layer's router input predicts its experts (the input
        changes by one residual update in between, so the top-k mostly survives)."""
        if layer is not None and PrefetchSource.LOOKAHEAD in self.prefetch:
            ids, _ = route(x @ self.w.layer(layer, "router").T, self.config.num_experts_per_tok, False)
            cache.prefetch(layer, experts_by_count(ids))

    def _stream_experts(self, layer: int):
        def stream(active):
            for e, slot in self.cache.stream(layer, active):
                yield e, self.copy_engine.weights(layer, slot)

        return stream

    def _project(self, i: int, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.w.layer(i, f"{name}_proj").T
        bias = self.w.optional(i, f"{name}_bias")
        return y + bias if bias is not None else y

    def _attention(
        self, i: int, x: np.ndarray, batch: ForwardBatch, kv: KVPool, cos: np.ndarray, sin: np.ndarray
    ) -> np.ndarray:
        cfg, T = self.config, x.shape[0]
        q, k, v = (self._project(i, x, n) for n in ("q", "k", "v"))
        if cfg.qk_norm is QKNorm.FULL:
            q = rms_norm(q, self.w.layer(i, "q_norm"), cfg.rms_norm_eps)
            k = rms_norm(k, self.w.layer(i, "k_norm"), cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (np.clip(t, -cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.reshape(T, cfg.num_attention_heads, cfg.head_dim)
        k = k.reshape(T, cfg.num_key_value_heads, cfg.head_dim)
        v = v.reshape(T, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm is QKNorm.PER_HEAD:
            q = rms_norm(q, self.w.layer(i, "q_norm"), cfg.rms_norm_eps)
            k = rms_norm(k, self.w.layer(i, "k_norm"), cfg.rms_norm_eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_kv(kv.k[i], kv.v[i], k, v, batch.slot_mapping)
        out = paged_attention(
            q,
            kv.k[i],
            kv.v[i],
            batch.seq_starts,
            batch.context_lens,
            batch.block_tables,
            batch.positions,
            cfg.head_dim**-0.5,
            cfg.sliding_windows[i],
        )
        return self._project(i, out.reshape(T, cfg.q_size), "o")

    def _mlp(self, i: int, x: np.ndarray, trace: StepTrace | None, planned: np.ndarray | None) -> np.ndarray:
        cfg = self.config
        if not cfg.sparse_layers[i]:
            return swiglu_mlp(x, self.w.layer(i, "gate_proj"), self.w.layer(i, "up_proj"), self.w.layer(i, "down_proj"))
        stream = self._stream_experts(i) if self.cache is not None else None
        out, expert_ids = sparse_moe(
            x,
            self.w.layer(i, "router"),
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            lambda e: self.w.expert(i, e),
            planned,
            stream,
        )
        if trace is not None:
            trace.expert_ids[i] = expert_ids
        if cfg.shared_expert_intermediate_size:
            shared = swiglu_mlp(
                x,
                self.w.layer(i, "shared_gate_proj"),
                self.w.layer(i, "shared_up_proj"),
                self.w.layer(i, "shared_down_proj"),
            )
            gate = x @ self.w.layer(i, "shared_expert_gate").T  # [T, 1]
            out = out + shared / (np.float32(1.0) + np.exp(-gate))
        return out
