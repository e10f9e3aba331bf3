"""The MoE model's forward pass on the cuda backend, as kernel launches in the order they run: embedding, then
per layer the input norm, attention (q/k/v, q/k norms, RoPE and the KV write, decode or prefill attention, o),
the post-attention norm and the MoE block (cuda/moe.py) or dense MLP, then the head (final norm, LM head,
argmax on the device). It reads a step the runner (cuda/decoder.py) staged into the workspace and knows
nothing of buckets, graphs or host copies. Which of the alternative kernels each launch takes is `options`
(engine/cuda_options.py), read while a pass is issued: a captured graph keeps the path it was captured with."""

from __future__ import annotations

import numpy as np
from numba import cuda

from common.model_config import ModelConfig, QKNorm
from expert_service.cuda.attention_8bit import DeviceAttention8Bit
from expert_service.cuda.l2_warm import L2Warmer
from expert_service.cuda.linear import GEMV_MAX_TOKENS, DeviceLinear
from expert_service.cuda.linear_8bit import EightBitRows, Matrix8Bit
from expert_service.cuda.moe import DeviceMoe
from expert_service.cuda.moe_cached import CachedExperts
from expert_service.cuda.weights import DeviceWeights
from expert_service.cuda.workspace import (
    decode_split_count,
    decode_split_views,
    shared_split_count,
    shared_split_views,
)
from expert_service.engine.cuda_options import CudaOptions
from expert_service.kernels import elementwise, greedy, rmsnorm
from expert_service.kernels.attention_decode import launch_attention_decode
from expert_service.kernels.attention_decode_mma import MMA_DECODE_MIN_SEQS, launch_attention_decode_mma
from expert_service.kernels.attention_decode_mma import supports as mma_decode_supports
from expert_service.kernels.attention_decode_shared import launch_attention_decode_shared
from expert_service.kernels.attention_decode_tiled import launch_attention_decode_fastest
from expert_service.kernels.attention_prefill_mma import launch_attention_prefill_fastest
from expert_service.kernels.embedding import launch_embedding
from expert_service.kernels.gather import launch_gather_rows
from expert_service.kernels.greedy_split import launch_greedy_split
from expert_service.kernels.kv_write import launch_kv_write
from expert_service.kernels.qk_norm_rope_kv_write import launch_qk_norm_rope_kv_write
from expert_service.kernels.qk_norm_rope_kv_write import supports as supports_fused_qk_norm
from expert_service.kernels.rope import launch_rope
from expert_service.kernels.rope_kv_write import launch_rope_kv_write


class CudaModel:
    """Embedding, every decoder layer and the head over the workspace's staged step. k_pool / v_pool: the paged
    KV cache [layers, blocks, block size, KV heads, head size]; `cached`: the expert cache (None: every expert
    resident); `planned`: routing=lut; host_break: where a captured pass hands over to the host (the MoE's)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: DeviceWeights,
        workspace,
        linear: DeviceLinear,
        stream,
        k_pool,
        v_pool,
        cached: CachedExperts | None,
        options: CudaOptions,
        planned: bool,
        host_break,
    ):
        self.config, self.weights, self.ws, self.linear, self.stream = config, weights, workspace, linear, stream
        self.k_pool, self.v_pool, self.cached, self.options = k_pool, v_pool, cached, options
        inv_freq, self.rope_scale = config.rope.inverse_frequencies(config.head_dim)
        self.inv_freq = cuda.to_device(inv_freq.astype(np.float32), stream=stream)
        self.head_8bit: tuple[Matrix8Bit, EightBitRows] | None = None  # the head and what runs it
        if (head := weights.head_8bit) is not None:
            self.head_8bit = head, EightBitRows(workspace.logits.shape[0], head.n_in, head.takes_mma, stream)
        self.attention_8bit: DeviceAttention8Bit | None = None
        if weights.attention_8bit is not None:
            rows = workspace.hidden.shape[0]
            dense_rows = options.attention_8bit_dense_rows
            self.attention_8bit = DeviceAttention8Bit(weights.attention_8bit, weights, rows, stream, linear, dense_rows)
        self.moe = DeviceMoe(
            config, weights, workspace, linear, stream, cached, options=options, planned=planned, host_break=host_break
        )
        self.warm: L2Warmer | None = None  # built when CudaOptions.l2_prefetch is first on: off, nothing is uploaded
        self._warm_built = False
        self._build_warmer(options)
        self._use_8bit_rows_options(options)

    def _use_8bit_rows_options(self, options: CudaOptions) -> None:
        """CudaOptions.q8_layout_at_launch for the 8-bit LM head's and attention projections' launches."""
        if self.head_8bit is not None:
            self.head_8bit[1].layout_at_launch = options.q8_layout_at_launch
        if self.attention_8bit is not None:
            self.attention_8bit.rows.layout_at_launch = options.q8_layout_at_launch

    def _build_warmer(self, options: CudaOptions) -> None:
        if options.l2_prefetch and not self._warm_built:
            self.warm, self._warm_built = L2Warmer.make(self.config, self.weights, self.stream), True

    def use_options(self, options: CudaOptions) -> None:
        """The paths the next passes take (the runner drops the graphs captured with the old ones)."""
        self._build_warmer(options)
        self.options = self.moe.options = options
        if self.attention_8bit is not None:
            self.attention_8bit.use_options(options)
        self._use_8bit_rows_options(options)

    def layers(self, T: int, S: int, decode: bool, shared: bool = False) -> None:
        """Embedding and every decoder layer on the staged step: ws.hidden[:T] holds the final residual. shared: a
        decode step whose staged groups share prefix blocks (the workspace's share_starts / share_members)."""
        cfg, ws, w, st = self.config, self.ws, self.weights, self.stream
        h, x = ws.hidden[:T], ws.normed[:T]
        # decodes of a step launched before the one ahead was collected read their token from its argmax
        launch_embedding(
            ws.token_ids[:T], w.get("embed_tokens"), h, stream=st, feed=ws.feed_rows[:T], fed=ws.greedy_ids
        )
        normed = False  # x already holds this layer's input norm (the previous MoE combine wrote it)
        if self.cached is not None:
            self.cached.start_pass(T, large=self.moe.cached_large(T), prefetch_yields=self.options.prefetch_yields)
        if self.attention_8bit is not None:
            self.attention_8bit.start_pass(T)
        for i in range(cfg.num_hidden_layers):
            if not normed:
                rmsnorm.launch_rmsnorm(h, w.layer(i, "input_norm"), cfg.rms_norm_eps, x, stream=st)
            self._attention(i, x, h, T, S, decode, shared)
            rmsnorm.launch_rmsnorm(h, w.layer(i, "post_attn_norm"), cfg.rms_norm_eps, x, stream=st)
            normed = False
            if cfg.sparse_layers[i]:
                last = i + 1 == cfg.num_hidden_layers
                fuse = self.options.fused_combine_norm and not last
                warm = self._warm(decode)
                next_norm = w.layer(i + 1, "input_norm") if fuse else None
                normed = self.moe.forward(i, x, h, T, next_norm=next_norm, warm=warm)
            else:
                g = ws.dense_gate[:T]
                self.linear.swiglu(x, w.layer(i, "gate_proj"), w.layer(i, "up_proj"), g, ws.dense_up[:T])
                self.linear.linear(g, w.layer(i, "down_proj"), h, accumulate=True)
        if self.cached is not None:
            self.cached.end_pass()

    def head(self, T: int, R: int) -> None:
        """Final norm and LM head on the hidden rows `logits_rows[:R]`, then the device-side argmax (and
        non-finite flags)."""
        cfg, ws, w, st = self.config, self.ws, self.weights, self.stream
        h = ws.hidden[:T]
        last = ws.last_hidden[:R]
        launch_gather_rows(h, ws.logits_rows[:R], last, stream=st)
        rmsnorm.launch_rmsnorm(last, w.get("final_norm"), cfg.rms_norm_eps, last, stream=st)
        if self.head_8bit is not None:
            head, rows = self.head_8bit
            rows.set_rows(R)
            rows.apply(head, rows.inputs(last), ws.logits[:R])
        else:
            self.linear.linear(last, w.lm_head, ws.logits[:R])
        if self.options.greedy_split:
            launch_greedy_split(
                ws.logits[:R],
                ws.greedy_ids[:R],
                ws.nonfinite[:R],
                ws.greedy_part_values[:R],
                ws.greedy_part_ids[:R],
                ws.greedy_part_flags[:R],
                stream=st,
            )
        else:
            greedy.launch_greedy(ws.logits[:R], ws.greedy_ids[:R], ws.nonfinite[:R], stream=st)

    def _attention(self, i: int, x, h, T: int, S: int, decode: bool, shared: bool) -> None:
        cfg, ws, w, st = self.config, self.ws, self.weights, self.stream
        q, k, v = self.qkv_views(T)
        qkv, qkv_bias = w.layer(i, "qkv_proj"), w.layer(i, "qkv_bias")
        width = cfg.q_size + 2 * cfg.kv_size
        stacked = ws.qkv[:width].reshape(1, width) if T == 1 else None  # [q | k | v]: the views' one row
        if self.attention_8bit is not None:
            self.attention_8bit.qkv(i, x, q, k, v, stacked, self.options.fused_qkv)
        elif (
            self.options.fused_qkv
            and T == 1
            and T <= GEMV_MAX_TOKENS
            and qkv is not None
            and (qkv_bias is not None or w.layer(i, "q_bias") is None)
        ):
            # one GEMV over the q|k|v rows: the k and v ones alone are too small to keep HBM busy
            self.linear.linear(x, qkv, stacked, bias=qkv_bias)
        else:
            xc = self.linear.as_weight_dtype(x) if T > GEMV_MAX_TOKENS else None
            for name, out in (("q", q), ("k", k), ("v", v)):
                self.linear.linear(x, w.layer(i, f"{name}_proj"), out, bias=w.layer(i, f"{name}_bias"), xc=xc)
        if (warm := self._warm(decode)) is not None:  # o and the router arrive in L2 while attention runs
            warm.attention(i)
        H, Hkv, Hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q3, k3, v3 = q.reshape(T, H, Hd), k.reshape(T, Hkv, Hd), v.reshape(T, Hkv, Hd)
        if self.fused_qk_norm:  # per-head q/k norms, RoPE and the KV write in one launch
            launch_qk_norm_rope_kv_write(
                q3,
                k3,
                v3,
                w.layer(i, "q_norm"),
                w.layer(i, "k_norm"),
                cfg.rms_norm_eps,
                ws.positions[:T],
                self.inv_freq,
                self.rope_scale,
                ws.slot_mapping[:T],
                self.k_pool[i],
                self.v_pool[i],
                stream=st,
            )
        else:
            self._qk_norm_rope_kv_write(i, q, k, v, T)
        attn3 = ws.attn[:T].reshape(T, H, Hd)
        window, scale = cfg.sliding_windows[i] or 0, Hd**-0.5
        if decode:
            attend = launch_attention_decode_fastest if self.options.tiled_decode_attention else launch_attention_decode
            pool = self.k_pool[i]
            if (
                self.options.mma_decode_attention
                and S >= MMA_DECODE_MIN_SEQS
                and mma_decode_supports(pool.dtype, Hd, pool.shape[1], H // Hkv)
            ):
                attend = launch_attention_decode_mma
            part_out, part_ml = decode_split_views(ws, cfg, S, self._decode_splits(S))
            paged = (q3, self.k_pool[i], self.v_pool[i], ws.block_tables[:S], ws.context_lens[:S], ws.positions[:S])
            if shared and window == 0 and attend is launch_attention_decode_mma:
                groups = (ws.share_starts[:S], ws.share_members[:S])
                splits = shared_split_count(cfg, S, ws.share_members.shape[1])
                shared_out, shared_ml = shared_split_views(ws, cfg, S, splits)
                launch_attention_decode_shared(
                    *paged,
                    *groups,
                    window,
                    scale,
                    attn3,
                    part_out,
                    part_ml,
                    shared_out,
                    shared_ml,
                    stream=st,
                    min_keys=self.options.decode_part_keys,
                )
            else:
                attend(
                    *paged, window, scale, attn3, part_out, part_ml, stream=st, min_keys=self.options.decode_part_keys
                )
        else:
            launch_attention_prefill_fastest(
                q3,
                self.k_pool[i],
                self.v_pool[i],
                ws.seq_starts[: S + 1],
                ws.positions[:T],
                ws.block_tables[:S],
                ws.context_lens[:S],
                window,
                scale,
                attn3,
                stream=st,
            )
        if self.attention_8bit is not None:
            self.attention_8bit.o(i, ws.attn[:T], h)
        else:
            self.linear.linear(ws.attn[:T], w.layer(i, "o_proj"), h, bias=w.layer(i, "o_bias"), accumulate=True)

    def _warm(self, decode: bool) -> L2Warmer | None:
        """The L2 prefetches of a decode step under CudaOptions.l2_prefetch (None: none)."""
        return self.warm if decode and self.options.l2_prefetch else None

    def qkv_views(self, T: int):
        """q [T, q_size], k and v [T, kv_size] of a step: consecutive ranges of workspace.qkv, so at T = 1 they
        are the row [q | k | v] one GEMV over the stacked weight rows writes."""
        nq, nkv, flat = self.config.q_size, self.config.kv_size, self.ws.qkv
        return (
            flat[: T * nq].reshape(T, nq),
            flat[T * nq : T * (nq + nkv)].reshape(T, nkv),
            flat[T * (nq + nkv) : T * (nq + 2 * nkv)].reshape(T, nkv),
        )

    def _decode_splits(self, S: int) -> int:
        """The split-K parts of a decode step of S sequences' attention: those of the largest batch (the workspace's
        max_seqs) at every S, or with CudaOptions.decode_splits_per_step decode_splits of S itself."""
        seqs = S if self.options.decode_splits_per_step else self.ws.last_hidden.shape[0]
        return decode_split_count(self.config, seqs)

    def _qk_norm_rope_kv_write(self, i: int, q, k, v, T: int) -> None:
        """The q/k norms (if any), the clamp (if any), RoPE on q and k and the KV write, launch by launch."""
        cfg, ws, w, st = self.config, self.ws, self.weights, self.stream
        H, Hkv, Hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if cfg.qk_norm is QKNorm.FULL:
            rmsnorm.launch_rmsnorm(q, w.layer(i, "q_norm"), cfg.rms_norm_eps, q, stream=st)
            rmsnorm.launch_rmsnorm(k, w.layer(i, "k_norm"), cfg.rms_norm_eps, k, stream=st)
        elif cfg.qk_norm is QKNorm.PER_HEAD:
            rmsnorm.launch_rmsnorm(
                q.reshape(T * H, Hd), w.layer(i, "q_norm"), cfg.rms_norm_eps, q.reshape(T * H, Hd), stream=st
            )
            rmsnorm.launch_rmsnorm(
                k.reshape(T * Hkv, Hd), w.layer(i, "k_norm"), cfg.rms_norm_eps, k.reshape(T * Hkv, Hd), stream=st
            )
        if cfg.clip_qkv is not None:
            for t in (q, k, v):
                elementwise.launch_clamp(t, cfg.clip_qkv, stream=st)
        q3, k3, v3 = q.reshape(T, H, Hd), k.reshape(T, Hkv, Hd), v.reshape(T, Hkv, Hd)
        if self.options.fused_rope_kv:  # the rotated keys go straight to the pool (k itself stays unrotated)
            launch_rope_kv_write(
                q3,
                k3,
                v3,
                ws.positions[:T],
                self.inv_freq,
                self.rope_scale,
                ws.slot_mapping[:T],
                self.k_pool[i],
                self.v_pool[i],
                stream=st,
            )
        else:
            launch_rope(q3, k3, ws.positions[:T], self.inv_freq, self.rope_scale, stream=st)
            launch_kv_write(k3, v3, ws.slot_mapping[:T], self.k_pool[i], self.v_pool[i], stream=st)

    @property
    def fused_qk_norm(self) -> bool:
        """Whether the per-head q/k norms run inside qk_norm_rope_kv_write (its options on, a model it takes)."""
        cfg, options = self.config, self.options
        return (
            options.fused_qk_norm
            and options.fused_rope_kv
            and cfg.qk_norm is QKNorm.PER_HEAD
            and cfg.clip_qkv is None
            and supports_fused_qk_norm(cfg.head_dim)
        )
