"""The cuda decoder's warm-up: the steps that compile and load every kernel and capture every graph serving can
replay (CudaDecoder.warmup), so that serving compiles nothing and allocates nothing on the device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from expert_service.cuda.moe_strategy import MoeStrategy, warmup_tokens
from expert_service.cuda.staging import GRAPH_BUCKETS
from expert_service.engine.step import ForwardBatch
from expert_service.kernels.attention_decode_mma import MMA_DECODE_MIN_SEQS

if TYPE_CHECKING:
    from expert_service.cuda.decoder import CudaDecoder


def decode_key(bucket: int, shared: bool) -> int | tuple[int, bool]:
    """The graph of a decode step padded to `bucket` sequences: its own, or one more when its sequences share
    prefix blocks (attention_decode_shared's launches)."""
    return (bucket, True) if shared else bucket


def warmup_steps(dec: CudaDecoder) -> None:
    """Compiles, loads and captures what serving would otherwise do on its first steps (CudaDecoder.warmup)."""
    cfg = dec.config
    span = min(dec.max_tokens, dec.max_blocks_per_seq * dec.block_size)  # one sequence's most tokens
    bf16 = dec.weights.dtype == np.uint16
    sizes = warmup_tokens(
        dec.max_tokens,
        cfg.num_experts_per_tok,
        cfg.num_experts,
        bf16=bf16,
        options=dec.options,
        quantized=dec.weights.quantized,
        q8_mma=dec._q8_mma(dec.options),
        cached_grouped=dec._cached_grouped(dec.options) if dec.cached is not None else 0,
        cached_mma=dec.cached is not None and dec.cached.mma_possible and dec.options.cached_mma,
        dims=(cfg.moe_intermediate_size, cfg.hidden_size),
        few_expert_mma=dec._few_expert_mma(dec.options),
    )
    # every token bucket a step can reach (several sequences fill the ones above span) that replays a graph
    buckets = (
        [b for b in dec.prefill_buckets if dec._prefill_bucket(b) == b and -(-b // span) <= dec.max_seqs]
        if dec.engine_config.cuda_graphs
        else []
    )
    for T in sorted({t for t in sizes if t <= span} | set(buckets)):
        warmup_step(dec, T, span, logits=True)
    if dec.cached is None and MoeStrategy.CUBLAS_PER_EXPERT in dec._strategies(dec.options, False):
        dec.model.moe.warm_cublas_shapes(dec.max_tokens)
    for T in buckets:  # without logits rows, so a one-token step takes its token bucket (not decode)
        for _ in range(2):  # first sight eager, then captured (already captured: replayed)
            warmup_step(dec, T, span, logits=False)
    # the padded steps' LM heads (none without prefill graphs), on the hidden state the warm-up left
    for rows in (b for b in GRAPH_BUCKETS if b <= dec.max_seqs) if buckets else ():
        for _ in range(2):
            dec._stage(padding_batch(), 1, 1, rows)
            dec._head(rows)
            dec.stream.synchronize()
    if not dec.engine_config.cuda_graphs:
        # eager decode: padded steps of one sequence and of MMA_DECODE_MIN_SEQS load both decode attentions
        for seqs in sorted({1, min(dec.max_seqs, dec.max_tokens, MMA_DECODE_MIN_SEQS)}):
            for shared in dec.decode_variants:
                dec._stage(padding_batch(), seqs, seqs, seqs, decode=True)  # no groups: shared launches idle
                dec._run(seqs, seqs, seqs, decode=True, shared=shared)
                dec.stream.synchronize()
        return
    # decode graphs, with and without shared prefixes where the engine has them (padding: every group empty)
    for bucket in (b for b in GRAPH_BUCKETS if b <= min(dec.max_seqs, dec.max_tokens)):
        for shared in dec.decode_variants:
            for _ in range(2):
                dec._stage(padding_batch(), bucket, bucket, bucket, decode=True)
                dec.graphs.run(
                    decode_key(bucket, shared), lambda b=bucket, sh=shared: dec._run(b, b, b, decode=True, shared=sh)
                )
                dec.stream.synchronize()


def warmup_step(dec: CudaDecoder, T: int, span: int, logits: bool) -> None:
    """A forward of T zero tokens in as few sequences of at most `span` tokens as hold them: they read the
    zeroed KV pool and write none; with `logits`, each sequence's last position is a logits row."""
    lens = np.diff(np.linspace(0, T, -(-T // span) + 1).astype(np.int64))
    ends = np.cumsum(lens)
    batch = ForwardBatch(
        token_ids=np.zeros(T, np.int64),
        positions=np.concatenate([np.arange(n, dtype=np.int64) for n in lens]),
        seq_starts=np.concatenate([[0], ends]),
        context_lens=lens,
        block_tables=[np.zeros(-(-n // dec.block_size), np.int64) for n in lens],
        slot_mapping=np.full(T, -1, np.int64),
        logits_rows=ends - 1 if logits else np.zeros(0, np.int64),
    )
    dec.forward(batch)
    dec.stream.synchronize()  # the next _stage rewrites the pinned staging this upload reads


def padding_batch() -> ForwardBatch:
    """A step of no sequences: _stage pads it to any bucket (padding writes no KV, attends to nothing)."""
    empty = np.zeros(0, np.int64)
    return ForwardBatch(
        token_ids=empty,
        positions=empty,
        seq_starts=np.zeros(1, np.int64),
        context_lens=empty,
        block_tables=[],
        slot_mapping=empty,
        logits_rows=empty,
    )
