"""The step runner of the cuda backend (the same steps as expert_service/cpu/decoder.py): it stages each step,
pads it to a bucket, replays or captures its CUDA graph and hands back its logits; the forward pass's kernel
launches are cuda/model.py's, which alternative kernels they take engine/cuda_options.py's.

One non-blocking stream carries everything. Decode-only steps of up to 64 sequences replay a CUDA graph
captured per batch-size bucket (padded sequences write no KV and attend to nothing). Other steps (prefills,
prefill chunks mixed with decodes) are padded to a token bucket (`prefill_buckets`: powers of two and 1.5x
powers of two) and replay a graph of the layers captured per bucket (`moe_strategy.CAPTURABLE`; with the expert cache
too: its slot map and copies are decided on the device). Where a MoE block needs the host mid-pass (per-expert
cuBLAS GEMMs sized by the step's expert offsets, resident or cached) the graph is captured in pieces around that host step (driver.HostBreaks, shared by both graph caches). The
padding tokens form one extra sequence that writes no KV and attends to nothing. The LM head of such a step
replays a graph of its own, per bucket of logits rows (GRAPH_BUCKETS; padded rows point at some token row of the
step, padding included, and are never read): run eagerly, its half-dozen launches cost more host time than the head's device time.
Everything else runs eagerly. Two steps may be in flight: each
stages into its own host copy of the metadata and results (double buffers, workspace.HOST_TWINS). With
routing=lut each step's routing plan is staged with its metadata (workspace.stage_routed_ids) and the MoE
layers route from it (cuda/moe.py).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import numpy as np
from cuda.bindings import driver as drv
from numba import cuda

from common.model_config import ModelConfig
from common.model_format import ModelDir
from expert_service.cuda.cublas import Cublas
from expert_service.cuda.device_logits import DeviceLogits
from expert_service.cuda.device_memory import (
    blocks_per_sequence,
    check_device_memory,
    kv_pool_shape,
    out_of_memory_as_error,
)
from expert_service.cuda.driver import Event, GraphCache, HostBreaks, check, device_address, non_blocking_stream
from expert_service.cuda.linear import DeviceLinear
from expert_service.cuda.model import CudaModel
from expert_service.cuda.moe_cached import CachedExperts, dense_scratch_needed
from expert_service.cuda.moe_strategy import (
    CAPTURABLE,
    ON_DEVICE,
    ModelStrategies,
    MoeStrategy,
    step_strategy,
)
from expert_service.cuda.penalties import DevicePenalties
from expert_service.cuda.shared_prefix import shared_members
from expert_service.cuda.staging import (
    GRAPH_BUCKETS,
    decode_key,
    padding_batch,
    prefill_buckets,
    stage_step,
    warmup_batch,
)
from expert_service.cuda.token_masks import DeviceMasks
from expert_service.cuda.weights import DeviceWeights
from expert_service.cuda.workspace import HOST_TWINS, allocate_workspace
from expert_service.engine.config import Backend, EngineConfig, RoutingMode
from expert_service.engine.cuda_options import CudaOptions
from expert_service.engine.step import ForwardBatch, HostLogits, Logits, StepTrace
from expert_service.experts.routing_plan import worker_plan_table
from expert_service.experts.slots import SlotPlan
from expert_service.kernels import programmatic
from expert_service.kernels.attention_decode_mma import MMA_DECODE_MIN_SEQS

log = logging.getLogger("colibri.worker.cuda")


@dataclass(frozen=True, slots=True)
class LaunchedForward:
    """A step issued on the stream: its results are on their way to host copy `twin` of the readbacks."""

    twin: int
    rows: int  # logits rows
    penalized: int  # the first rows, penalised on the device
    padded: int  # the bucket it was padded to
    topk_ids: int  # MoE top-k ids read back (0: not traced)
    done: Event | None  # recorded after the readback (None: synchronous, or waiting for late masks)
    host_logits: HostLogits | None = None  # every-position logits, already on the host (a synchronous step)
    tokens: int = 0  # its real tokens
    staged: int = 0  # the decoder's staged-step count after staging it (DeviceLogits' check)
    masks: np.ndarray | None = None  # the grammar masks of its first rows (masked on the device)


class CudaDecoder:
    """The engine's Decoder on the GPU: runs each step's CudaModel pass, padded, through its graph."""

    backend = Backend.CUDA

    @out_of_memory_as_error("loading the model")
    def __init__(self, model: ModelDir, config: EngineConfig, slot_plan: SlotPlan):
        self.slot_plan = slot_plan
        self.config: ModelConfig = model.config
        self.engine_config = config
        cached = slot_plan.is_cached
        # the expert cache's plan prefetch table (the worker's own lookup), or None: the router's plans; read before
        # the weights upload, so a table that does not fit fails at once
        self.plan_lookup = worker_plan_table(model, config) if cached else None
        table_bytes = self.plan_lookup.table.size * 2 if self.plan_lookup is not None else 0  # uploaded as uint16
        self.device_plan = check_device_memory(model, config, slot_plan, table_bytes)  # a misfit is refused here
        self._stream_handle, self.stream = non_blocking_stream()
        self.weights = DeviceWeights(
            model, self.stream, config.use_pinned_memory, load_experts=not cached, facts=self.device_plan.facts
        )
        cfg = self.config
        self.kv_dtype = self.weights.dtype
        self.num_blocks, self.block_size = config.resolved_num_kv_blocks, config.kv_block_size
        pool_shape = kv_pool_shape(cfg, self.num_blocks, self.block_size)
        self.k_pool = cuda.device_array(pool_shape, dtype=self.kv_dtype, stream=self.stream)
        self.v_pool = cuda.device_array(pool_shape, dtype=self.kv_dtype, stream=self.stream)
        for pool in (self.k_pool, self.v_pool):  # finite garbage: warm-up steps attend over unwritten blocks
            check(drv.cuMemsetD8Async(device_address(pool), 0, pool.nbytes, self._stream_handle))
        self.max_tokens, self.max_seqs = config.max_batch_tokens, config.max_batch_size
        self.seq_slots = self.max_seqs + 1  # the workspace's sequence slots: a step's, and a padding one
        self.max_blocks_per_seq = blocks_per_sequence(cfg, self.num_blocks, self.block_size)
        self.moe_layers = cfg.moe_layers
        self.planned_routing = config.routing is RoutingMode.LUT  # each step routes by its plan (routed_ids)
        # laid out by the memory check from the model directory's expert facts, the ones DeviceWeights took
        workspace = self.device_plan.workspace
        self.workspace_layout, self.workspace_cached_grouped = workspace.layout, workspace.cached_grouped
        self.workspace_w8a8_min_rows, self.workspace_shared_members = workspace.w8a8_min_rows, workspace.shared_members
        # what the workspace was laid out for: set_options refuses options that reach another strategy
        self.workspace_strategies = self.strategies.reachable(config.cuda_options, cached)
        if cached:  # the cache's grouped waves and its per-expert cuBLAS read the same per-assignment rows
            self.workspace_strategies |= {MoeStrategy.CACHED_GROUPED, MoeStrategy.CACHED_CUBLAS}
        self.ws = allocate_workspace(self.workspace_layout, self.stream)
        self.penalties = DevicePenalties(
            self.max_seqs, cfg.vocab_size, self.max_seqs, self.max_tokens, self.ws, self.stream
        )
        self.token_masks = DeviceMasks(self.max_seqs, cfg.vocab_size, self.ws, self.stream)
        self.host_breaks = HostBreaks(self.stream)  # where a captured pass hands over to the host
        self.graphs = GraphCache(self.stream, self.host_breaks)  # decode steps, by batch-size bucket
        self.prefill_graphs = GraphCache(self.stream, self.host_breaks)  # the layers of other steps, by token bucket
        self.head_graphs = GraphCache(self.stream, self.host_breaks)  # their LM heads, by logits-row bucket
        self.staged_steps = 0  # every staged step overwrites ws.logits (DeviceLogits checks it)
        self._twin = 0  # the host copy of metadata and results the latest launched step uses
        self._done = [Event() for _ in range(HOST_TWINS)]  # each copy's step: its readback has landed
        self._unfinished: set[int] = set()  # copies whose step is launched, not finished
        # the cuBLAS handle is created before any graph capture (cublasCreate cannot run inside one)
        self.cublas = Cublas(self.stream, self.ws.cublas_workspace)
        self.linear = DeviceLinear(self.stream, self.cublas, self.ws, self.weights.dtype)
        self.cached = (
            CachedExperts(
                cfg,
                self.weights,
                self.ws,
                self.linear,
                self.stream,
                self.max_tokens,
                slot_plan,
                config.prefetch_sources,
                config.expert_cache_policy,
                host_break=self.host_breaks,
                plan_table=self.plan_lookup.table if self.plan_lookup is not None else None,
                largest_grouped=self.workspace_cached_grouped,
                prefetch_large_steps=config.prefetch_large_steps,
            )
            if cached
            else None
        )  # None: every expert resident, no cache logic runs
        self._warn_if_programmatic_unusable(config.cuda_options)
        self.model = CudaModel(
            cfg,
            self.weights,
            self.ws,
            self.linear,
            self.stream,
            self.k_pool,
            self.v_pool,
            self.cached,
            config.cuda_options,
            planned=self.planned_routing,
            host_break=self.host_breaks,
        )
        self.stream.synchronize()

    @out_of_memory_as_error("warming up")
    def warmup(self) -> None:
        """Compiles and loads every kernel now -- prefills of moe_strategy.warmup_tokens (1, 2, 64, 65 and the first size
        of each grouped-MMA tile config and router) take each MoE strategy (one-token gemv, grouped kernels, all
        experts, per-expert GEMMs, grouped MMA) -- and captures the graph of every capturable prefill token bucket
        and every decode batch-size bucket, so serving never compiles and allocates nothing on the device (module
        loads and graph instantiation do). With the expert cache the same steps take the cached strategies."""
        self.penalties.warmup(self.ws.logits)
        self.token_masks.warmup(self.ws.logits, self.penalties.logits)
        span = min(self.max_tokens, self.max_blocks_per_seq * self.block_size)  # one sequence's most tokens
        # every token bucket a step can reach (several sequences fill the ones above span) that replays a graph
        buckets = [
            b
            for b in self.prefill_buckets
            if self.engine_config.cuda_graphs and self._prefill_bucket(b) == b and -(-b // span) <= self.max_seqs
        ]
        sizes = set(self.strategies.warmup_tokens(self.options, self.cached))
        if self.model.attention_8bit is not None:  # their GEMM's tile configs and split-K choices by step size
            sizes |= set(self.model.attention_8bit.warmup_rows())
        for T in sorted({t for t in sizes if t <= span} | set(buckets)):
            self._warm(warmup_batch(T, span, self.block_size, logits=True))
        if self.cached is None and MoeStrategy.CUBLAS_PER_EXPERT in self.strategies.reachable(self.options, False):
            self.model.moe.warm_cublas_shapes(self.max_tokens)
        for T in buckets:  # without logits rows, so a one-token step takes its token bucket (not decode)
            for _ in range(2):  # first sight eager, then captured (already captured: replayed)
                self._warm(warmup_batch(T, span, self.block_size, logits=False))
        # the padded steps' LM heads (none without prefill graphs), on the hidden state the warm-up left; an 8-bit
        # head's kernels at every row count they change at
        head_rows = {b for b in GRAPH_BUCKETS if b <= self.max_seqs} if buckets else set()
        if self.model.head_8bit is not None:
            head, head_runner = self.model.head_8bit
            counts = {self._head_rows(r) for r in range(1, self.max_seqs + 1)}
            head_rows |= set(head_runner.warmup_rows(counts, (head,)))
        for rows in sorted(head_rows):
            for _ in range(2):
                self._stage(padding_batch(), 1, 1, rows)
                self._head(rows)
                self.stream.synchronize()
        # decode: with graphs every batch bucket's (with and without shared prefixes where the engine has them;
        # padding: every group empty), eagerly padded steps of one sequence and of MMA_DECODE_MIN_SEQS (both kernels)
        graphs = self.engine_config.cuda_graphs
        eager = sorted({1, min(self.max_seqs, self.max_tokens, MMA_DECODE_MIN_SEQS)})
        for bucket in [b for b in GRAPH_BUCKETS if b <= min(self.max_seqs, self.max_tokens)] if graphs else eager:
            for shared in self.decode_variants:
                for _ in range(2 if graphs else 1):  # with graphs: first sight eager, then captured
                    self._stage(padding_batch(), bucket, bucket, bucket, decode=True)  # no groups: shared idle
                    run = functools.partial(self._run, bucket, bucket, bucket, decode=True, shared=shared)
                    self._replay(self.graphs, decode_key(bucket, shared), run)
                    self.stream.synchronize()
        if self.cached is not None:  # the warm-up's cache counts are nobody's step
            self.cached.settle_totals()

    def _warm(self, batch: ForwardBatch) -> None:
        self.forward(batch)
        self.stream.synchronize()  # the next _stage rewrites the pinned staging this upload reads

    # --- memory -------------------------------------------------------------------------------------
    def memory_plan(self) -> list[tuple[str, int]]:
        plan = [
            ("dense_weights", self.weights.dense_bytes),
            ("expert_weights", self.weights.expert_bytes),
            ("kv_cache", self.k_pool.nbytes + self.v_pool.nbytes),
            ("activations_and_workspace", self.ws.nbytes),
            ("penalties", self.penalties.nbytes),
            ("token masks", self.token_masks.nbytes),
        ]
        if self.cached is not None:
            plan.append(("expert_slots", self.cached.nbytes))
        runners = [self.model.head_8bit[1]] if self.model.head_8bit is not None else []
        runners += [self.model.attention_8bit.rows] if self.model.attention_8bit is not None else []
        if runners:  # launch tables, bf16 rows and split-K partials of the 8-bit head and attention projections
            plan.append(("8bit_matrix_rows", sum(r.nbytes for r in runners)))
        return plan

    @property
    def router_plan_width(self) -> int:
        """The predictions a token of the router's plans the cache's prefetch reads: its staging buffers hold the
        model's top-k a token; 0 where it reads no router plan (no cache, its own table, or no plan prefetch)."""
        if self.cached is None or not self.cached.reads_router_plans:
            return 0
        return self.cached.hint_width

    # --- step ---------------------------------------------------------------------------------------
    @property
    def supports_overlap(self) -> bool:
        """A step may be launched before the one ahead of it is collected (that one's argmax rows feed its
        decodes on the device); the expert cache's steps decide on the device too."""
        return True

    def forward(self, batch: ForwardBatch, trace: StepTrace | None = None) -> Logits:
        return self.finish(self.launch(batch, traced=trace is not None), trace)

    def blocks_host(self, num_tokens: int) -> bool:
        """Whether a step of this many tokens (padded to its bucket, or not: large decodes) may wait for the device
        inside the pass (per-expert cuBLAS, the expert cache): a step ahead of it is then answered only after it."""
        sizes = {num_tokens, self._prefill_bucket(num_tokens) or num_tokens}
        return any(self._strategy(T) not in ON_DEVICE for T in sizes) if self.config.moe_layers else False

    def _strategy(self, T: int) -> MoeStrategy:
        """The MoE strategy a step of T tokens takes on this model (cuda/moe_strategy.py step_strategy)."""
        return step_strategy(T, self.config, self.weights, self.cached, self.options)

    def launch(self, batch: ForwardBatch, traced: bool = False) -> LaunchedForward:
        """Issues the step on the stream without waiting for it; `finish` waits and hands over its logits. The
        step before may still be running: this one stages into the other host copy of the metadata and results,
        and its rows with batch.fed_rows take their input token from that step's argmax on the device."""
        T, S, R = len(batch.token_ids), len(batch.context_lens), len(batch.logits_rows)
        twin = (self._twin + 1) % HOST_TWINS
        if twin in self._unfinished:
            raise RuntimeError(f"{HOST_TWINS} steps are launched and not finished: finish the oldest first")
        self._twin = twin
        self._unfinished.add(twin)
        self.ws.select_twin(self._twin)
        if R > self.max_seqs and T <= self.max_tokens and S <= self.max_seqs:
            host = self._forward_all_rows(batch, T, S, R)
            return LaunchedForward(self._twin, R, 0, T, 0, None, host, tokens=T, staged=self.staged_steps)
        if T > self.max_tokens or S > self.max_seqs or R > self.max_seqs:
            raise ValueError(
                f"step of {T} tokens / {S} sequences exceeds the memory plan ({self.max_tokens} / {self.max_seqs})"
            )
        decode_only = T == S and R == S
        # steps pad to their bucket with or without graphs, so eager steps compute what replays do
        bucket = self._decode_bucket(S) if decode_only else None
        tokens = None if decode_only else self._prefill_bucket(T)
        padded = bucket or tokens or T
        if self.cached is not None:
            self.cached.stage_hints(batch.expert_hints, self._twin, padded)
        if bucket is not None:
            shared = self._stage(batch, bucket, bucket, bucket, decode=True) > 0
            key = decode_key(bucket, shared)
            self._replay(self.graphs, key, lambda: self._run(bucket, bucket, bucket, decode=True, shared=shared))
        elif tokens is not None:
            rows = self._head_rows(R)
            self._prefill_layers(batch, tokens, rows)
            if R:  # a prompt chunk that is not its prompt's last samples nothing
                self._head(rows)
        else:
            shared = self._stage(batch, T, S, R, decode=decode_only) > 0
            self._run(T, S, R, decode=decode_only, shared=shared)
        # penalties after the graph (or eager pass), before the argmax is read back: the common path runs none
        penalized = self.penalties.apply(batch.penalties, self.ws.logits) if batch.penalties is not None else 0
        n_ids = len(self.moe_layers) * padded * self.config.num_experts_per_tok if traced else 0
        step = LaunchedForward(self._twin, R, penalized, padded, n_ids, None, tokens=T, staged=self.staged_steps)
        return step if batch.masks_late else self._read_back(step, batch.token_masks)

    def complete(self, step: LaunchedForward, masks: np.ndarray) -> LaunchedForward:
        """Late masks of the step launched last: its masked argmax and readback are queued now, still before the
        next step's graph, which reads those ids as its fed tokens."""
        if step.done is not None or step.twin != self._twin or step.staged != self.staged_steps:
            raise RuntimeError("late masks complete the latest launched step, before another is staged")
        if step.host_logits is not None:  # a synchronous step: its rows are on the host, masked as they are read
            h = step.host_logits
            return replace(step, host_logits=HostLogits(h.array, h.penalized, masks))
        return self._read_back(step, masks)

    def _read_back(self, step: LaunchedForward, masks: np.ndarray | None) -> LaunchedForward:
        """The step's tail: grammar masks last (they read the penalised rows; the argmax of the masked rows
        replaces theirs), then the readback of its results and the event finish waits on."""
        if masks is not None:
            self.token_masks.apply(masks, self.ws.logits, self.penalties.logits, step.penalized, step.twin)
        if self.cached is not None:
            self.cached.download_stats(step.twin)
        results = self.ws.results
        assert results is not None  # allocate_workspace made it
        results.download(results.end_of("topk_ids", step.topk_ids), self._stream_handle)
        done = self._done[step.twin]
        done.record(self._stream_handle)
        return replace(step, done=done, masks=masks)

    def abandon(self) -> None:
        """Forgets launched, unfinished steps after a fault (their readbacks are never read): the host copies
        are free again once what was issued has run, which this waits for."""
        self._unfinished.clear()
        self.stream.synchronize()

    def ready(self, step: LaunchedForward) -> bool:
        """Whether a launched step's work and readback are done (finish would not wait)."""
        return step.done is None or step.done.ready()

    def finish(self, step: LaunchedForward, trace: StepTrace | None = None) -> Logits:
        """Waits for a launched step; its logits (the argmax already read back) and, with a trace, the MoE
        layers' expert ids of its real tokens."""
        self._unfinished.discard(step.twin)
        if step.host_logits is not None:
            return step.host_logits
        assert step.done is not None  # only a synchronous step (host_logits, returned above) has no event
        step.done.wait()
        if self.cached is not None:
            stats = self.cached.step_stats(step.twin)
            if trace is not None:
                trace.expert_cache = stats
        results = self.ws.results
        assert results is not None  # allocate_workspace made it
        host = results.twin_views[step.twin]
        if trace is not None and step.topk_ids:
            ids = host["topk_ids"].reshape(-1)[: step.topk_ids].reshape(len(self.moe_layers), step.padded, -1)
            T = step.tokens
            for index, layer in enumerate(self.moe_layers):
                trace.expert_ids[layer] = ids[index, :T].copy()
        return DeviceLogits(
            self, step.rows, step.penalized, host["greedy_ids"], host["nonfinite"], step.staged, step.masks
        )

    @property
    def strategies(self) -> ModelStrategies:  # the model's MoE strategy bounds under any options
        return ModelStrategies(self.config, self.weights, self.max_tokens)

    @functools.cached_property
    def prefill_buckets(self) -> list[int]:  # max_tokens is fixed: listed once, read by every step
        return prefill_buckets(self.max_tokens)

    def _prefill_capturable(self, tokens: int) -> bool:
        return self._strategy(tokens) in CAPTURABLE

    def _prefill_bucket(self, T: int) -> int | None:
        """The token bucket a non-decode step of T tokens is padded to (and replays), or None (unpadded, eager)."""
        if not self.options.prefill_graphs:
            return None
        tokens = next(b for b in self.prefill_buckets if b >= T)
        return tokens if self._prefill_capturable(tokens) else None

    def _head_rows(self, R: int) -> int:
        """The logits rows a padded step's LM head computes: R up to its graph bucket (staging points the padded
        rows at token rows of the step, never read; eager steps pad too, so they compute what replays do), or R
        itself past the buckets."""
        return next((b for b in GRAPH_BUCKETS if R <= b <= self.max_seqs), R) if R else 0

    def _head(self, rows: int) -> None:
        """A padded step's LM head on `rows` staged logits rows (any hidden row: the whole buffer's view), its
        bucket's graph (more rows than the buckets: eagerly)."""
        if rows in GRAPH_BUCKETS:
            self._replay(self.head_graphs, rows, lambda: self.model.head(self.max_tokens, rows))
        else:
            self.model.head(self.max_tokens, rows)

    def _decode_bucket(self, S: int) -> int | None:
        """The batch bucket a decode step of S sequences is padded to (and replays), or None (unpadded, eager)."""
        bucket = next((b for b in GRAPH_BUCKETS if b >= S), None)
        if bucket is None or bucket > min(self.max_seqs, self.max_tokens):
            return None
        return bucket

    @property
    def decode_variants(self) -> tuple[bool, ...]:
        """The decode passes this engine runs: without shared prefixes, and with them where the workspace holds
        their buffers and the options have them on (each its own graph per bucket)."""
        return (False, True) if self.workspace_shared_members and self.options.shared_prefix_attention else (False,)

    def _replay(self, graphs: GraphCache, key: int | tuple[int, bool], issue) -> None:
        """issue() on the stream: through `graphs` (eager, captured, replayed) with cuda_graphs, else eagerly."""
        if self.engine_config.cuda_graphs:
            graphs.run(key, issue)
        else:
            issue()

    def _prefill_layers(self, batch: ForwardBatch, tokens: int, rows: int) -> None:
        """Stages a non-decode step padded to its token bucket -- the real sequences, then one more holding every
        padding token, the other slots empty; its first `rows` logits rows -- and runs its layers (the bucket's
        graph)."""
        self._stage(batch, tokens, self.seq_slots, rows, table_rows=len(batch.context_lens) + 1, token_bucket=True)
        self._replay(self.prefill_graphs, tokens, lambda: self.model.layers(tokens, self.seq_slots, decode=False))

    def _forward_all_rows(self, batch: ForwardBatch, T: int, S: int, R: int) -> HostLogits:
        """More logits rows than the plan holds (`colibri logits`: every prompt position): the layers run
        once, the LM head in chunks of max_batch_size rows, each chunk copied to the host."""
        tokens = self._prefill_bucket(T)
        if self.cached is not None:
            self.cached.stage_hints(batch.expert_hints, self._twin, tokens or T)
        if tokens is not None:  # padded as a step with fewer rows would be: the same bits in its sampling rows
            self._prefill_layers(batch, tokens, 0)
            T = tokens
        else:
            self._stage(batch, T, S, 0)
            self._run(T, S, 0, decode=False)
        if self.cached is not None:  # its counts are dropped, but the running totals move past it
            self.cached.download_stats(self._twin)
            self.stream.synchronize()
            self.cached.step_stats(self._twin)
        rows = np.asarray(batch.logits_rows, dtype=np.int32)
        out, penalized = np.empty((R, self.config.vocab_size), dtype=np.float32), None
        for start in range(0, R, self.max_seqs):
            chunk = rows[start : start + self.max_seqs]
            n = len(chunk)
            self.ws.host["logits_rows"][:n] = chunk
            self.ws.logits_rows[:n].copy_to_device(self.ws.host["logits_rows"][:n], stream=self.stream)
            self.model.head(T, n)
            if start == 0 and batch.penalties is not None:  # the sampling rows come first
                rows_penalized = self.penalties.apply(batch.penalties, self.ws.logits)
                penalized = self.penalties.download(rows_penalized) if rows_penalized else None
            self.ws.logits[:n].copy_to_host(self.ws.host["logits"][:n], stream=self.stream)
            self.stream.synchronize()
            out[start : start + n] = self.ws.host["logits"][:n]
        return HostLogits(out, penalized, None if batch.masks_late else batch.token_masks)

    def _stage(
        self,
        batch: ForwardBatch,
        T: int,
        S: int,
        R: int,
        table_rows: int | None = None,
        token_bucket: bool = False,
        decode: bool = False,
    ) -> int:
        """The step's metadata to the device, padded to T tokens / S sequences (staging.stage_step); a decode
        step's groups of sequences sharing prefix blocks too where the options have shared_prefix_attention (the
        count is returned: 0, no shared launches)."""
        self.staged_steps += 1
        plan = (self.moe_layers, self.config.num_experts_per_tok) if self.planned_routing else None
        sharing = decode and any(self.decode_variants)
        return stage_step(
            self.ws,
            batch,
            T,
            S,
            R,
            self.max_blocks_per_seq,
            self._stream_handle,
            plan=plan,
            table_rows=table_rows,
            token_bucket=token_bucket,
            shared_block_size=self.block_size if sharing else 0,
        )

    # --- the forward pass (eager, or captured into a graph) -----------------------------------------
    def _run(self, T: int, S: int, R: int, decode: bool, shared: bool = False) -> None:
        with programmatic.launches(self.programmatic_launches if decode else programmatic.OFF):
            self.model.layers(T, S, decode, shared)
            if R:
                self.model.head(T, R)

    @functools.cached_property
    def _programmatic_usable(self) -> bool:
        """This engine's device (current when first asked: while it is built) is sm_90 or later, and it has no
        expert cache, whose copies write weights mid-step."""
        return self.cached is None and programmatic.supported()

    def _warn_if_programmatic_unusable(self, options: CudaOptions) -> None:
        if options.programmatic_launch and not self._programmatic_usable:
            log.warning(programmatic.refusal(self.cached is not None))

    @property
    def programmatic_launches(self) -> int:
        """The programmatic-launch level decode steps are issued at (programmatic_launch; 0: off): on an sm_90 or
        later device (the simulator runs the variants as plain kernels) without an expert cache, whose copies
        rewrite the slots the kernels stream weights from within the step."""
        return self.options.programmatic_launch if self._programmatic_usable else programmatic.OFF

    @property
    def options(self) -> CudaOptions:
        """The kernel paths the forward pass takes (EngineConfig.cuda_options until set_options)."""
        return self.model.options

    def set_options(self, options: CudaOptions) -> None:
        """Takes other kernel paths from the next step on (benchmarks and tests compare paths on one engine, with
        the same sequences, this way); the graphs captured with the old ones are dropped. Options under which some
        step would take a MoE strategy whose buffers the workspace lacks (it was laid out for the engine's
        configured options) are refused: build the engine with them instead."""
        missing = self.strategies.reachable(options, self.cached is not None) - self.workspace_strategies
        cached = self.cached
        if options.cached_mma and cached is not None and cached.mma_supported and not cached.mma_possible:
            missing.add(MoeStrategy.CACHED_GROUPED)  # on the tensor-core kernel: rows it was not laid out with
        grouped = min(self.strategies.cached_grouped(options), self.max_tokens)  # the rows of steps an engine can take
        if cached is not None and grouped > min(self.workspace_cached_grouped, self.max_tokens):
            missing.add(MoeStrategy.CACHED_GROUPED)  # larger steps in waves than its sorted rows were laid out for
        q8_mma = MoeStrategy.Q8_MMA in self.strategies.reachable(options, cached is not None)
        # W8A8's 8-bit rows, laid out for steps from workspace_w8a8_min_rows rows an expert (0: none)
        if options.q8_activations and q8_mma and not 0 < self.workspace_w8a8_min_rows <= options.w8a8_min_rows:
            missing.add(MoeStrategy.Q8_MMA)
        if (
            options.shared_prefix_attention
            and not self.workspace_shared_members
            and shared_members(self.config, self.kv_dtype, self.block_size, options)
        ):
            raise ValueError(
                "cuda_options: shared_prefix_attention needs buffers the workspace was not laid out for; give it to "
                "the engine's config instead"
            )
        if self.model.attention_8bit is not None and (why := self.model.attention_8bit.refusal(options)):
            raise ValueError(why)
        if missing:
            names = ", ".join(sorted(m.value for m in missing))
            raise ValueError(
                f"cuda_options: these options reach MoE strategies the workspace was not laid out for "
                f"({names}); give them to the engine's config instead"
            )
        if cached is not None and dense_scratch_needed(cached.quantized, self.max_tokens, grouped):
            try:  # 8-bit steps on per-expert cuBLAS under these options: their scratch made now, not mid-step
                cached.make_dense_scratch()
            except Exception as e:  # the pool and slots were sized at start-up without it
                raise ValueError(
                    f"cuda_options: per-expert cuBLAS on 8-bit experts needs a one-expert dense scratch the device "
                    f"could not give ({type(e).__name__}); give the options to the engine's config instead"
                ) from e
        self._warn_if_programmatic_unusable(options)
        self.drop_graphs()
        self.model.use_options(options)

    def drop_graphs(self) -> None:
        """Forgets the captured graphs: the next step of each bucket runs eagerly, then is captured again."""
        self.stream.synchronize()
        self.graphs.clear()
        self.prefill_graphs.clear()
        self.head_graphs.clear()

    def close(self) -> None:
        self.drop_graphs()
        for event in self._done:
            event.close()
        self.model.moe.close()
        self.cublas.close()
        if self.cached is not None:
            self.cached.close()
        self.weights.close()
