"""One engine of bench/offload.py measured: the engine built at a cache size and prefetch mode, its prefill and
decode steps timed (b=1 x 512, then each decode batch size), the expert-cache counts summed over them, and the
pinned host -> device bandwidth the PCIe bound is taken from."""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np

from bench.engine import pipelined_decode
from bench.kernel_timeline import step_timeline
from bench.offload_hf import DECODE_BATCHES, DECODE_CONTEXT, DECODE_STEPS, PREFILL_TOKENS
from bench.offload_model import TokenSource
from common.model_format import ModelDir
from common.routing_table import RoutingTable
from expert_service.backends import build_engine, cuda_available
from expert_service.engine.config import EngineConfig
from expert_service.engine.cuda_options import CudaOptions
from expert_service.engine.engine import Engine, PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.experts.cache import CacheStats

PREFILL_REPEATS, WARMUP_STEPS = 3, 3


def measure_pcie(nbytes: int = 512 << 20, repeats: int = 5) -> float | None:
    """Pinned host -> device bytes/s, best of `repeats` copies of `nbytes` on one stream; None without a GPU."""
    if not cuda_available():
        return None
    from numba import cuda

    host = cuda.pinned_array(nbytes, dtype=np.uint8)
    device = cuda.device_array(nbytes, dtype=np.uint8)
    stream = cuda.stream()
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy warms up
        start = time.perf_counter()
        device.copy_to_device(host, stream=stream)
        stream.synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def measure_fetch_kernel(block: int = 9 << 20) -> dict:
    """The expert fetch kernel's host -> device rate and the copy engine's, from registered mapped memory (blocks of
    a qwen3moe-shape expert's size): a cached step's misses run at the kernel's, which depends on the host."""
    from bench.pcie_fetch import fetch_kernel_bytes_per_s

    kernel, engine = fetch_kernel_bytes_per_s(block)
    return {"bytes_per_s": kernel, "copy_engine_bytes_per_s": engine, "x_copy_engine": kernel / engine}


def make_engine(
    model: ModelDir,
    backend: str,
    slots: int = 0,
    prefetch: str = "none",
    options: CudaOptions = CudaOptions(),
    plan_table: str = "router",
    policy: str = "lru",
    prefetch_large_steps: bool = False,
) -> Engine:
    return build_engine(
        model,
        EngineConfig(
            backend=backend,
            kv_block_size=16,
            kv_cache_tokens=8192,
            max_batch_tokens=2048,
            max_batch_size=16,
            expert_cache_slots=slots,
            prefetch=prefetch.replace("+", ","),
            cuda_options=options,
            plan_table=plan_table,
            expert_cache_policy=policy,
            prefetch_large_steps=prefetch_large_steps,
        ),
    )


def close(engine: Engine) -> None:
    decoder = engine.decoder
    closer = getattr(decoder, "close", None) or getattr(getattr(decoder, "copy_engine", None), "close", None)
    if closer is not None:
        closer()


def cache_stats(result) -> CacheStats:
    """The step's expert-cache counts; with every expert resident, each distinct expert per layer is a hit."""
    if result.expert_cache is not None:
        return result.expert_cache
    return CacheStats(hits=sum(len(np.unique(ids)) for ids in result.trace.expert_ids.values()))


def summarize(runs: list, tokens_per_step: int, bytes_per_s: float, pick=np.median) -> dict:
    """runs: [(seconds, StepResult)] of one phase -> tok/s, cache counts and the PCIe bound."""
    times = [t for t, _ in runs]
    stats = sum((cache_stats(r) for _, r in runs), CacheStats())
    step_s = float(pick(times))
    bound_s = stats.bytes_copied / len(runs) / bytes_per_s
    recalls = [r.routing_plan_recall for _, r in runs if r.routing_plan_recall is not None]
    return {
        "tok_s": tokens_per_step / step_s,
        "ms_per_step": step_s * 1e3,
        "steps": len(runs),
        **asdict(stats),
        "hit_rate": stats.hit_rate,
        "bytes_copied_per_token": stats.bytes_copied / (tokens_per_step * len(runs)),
        "stall_fraction": stats.stall_seconds / sum(times),
        "pcie_bound_ms": bound_s * 1e3,
        "x_pcie_bound": step_s / bound_s if bound_s else None,
        "plan_recall": float(np.mean(recalls)) if recalls else None,
    }


def bench_colibri(
    engine: Engine,
    table: RoutingTable | None,
    bytes_per_s: float,
    tokens: TokenSource,
    decode_steps: int = DECODE_STEPS,
    timeline: bool = False,
    temperature: float = 0.0,
) -> dict:
    """Prefill b=1 x 512, then decode at each batch size; the step's routing plan goes along when prefetching
    from the plan (looked up outside the timed region: the router does it before sending the step). Prompts
    come from `tokens`, the same ones for every engine. timeline (cuda): one more decode step per batch size
    recorded kernel by kernel (bench/kernel_timeline.py), to see which stream a step waited on.
    temperature > 0: the decode phases run again on new prompts whose continuations are sampled at that
    temperature (seed = the request id, so every engine samples the same way), into "decode_sampled": greedy
    continuations of a random or briefly trained model fall into loops that revisit the same experts and
    inflate hit rates."""
    take = tokens.sampler()
    thread = _model_thread(engine)
    use_plan = table is not None and "plan" in engine.config.prefetch_sources
    sync = getattr(getattr(engine.decoder, "stream", None), "synchronize", lambda: None)

    def chunk(rid: int, n: int, sampling: SamplingParams = SamplingParams()) -> PrefillInput:
        return PrefillInput(rid, take(n), sampling, True)

    def step(prefill=(), decode_ids=()):
        routing_plan = None
        if use_plan:  # the worker's token order: prompt chunks, then one token per decoding sequence
            last = np.array([engine.sequences[rid].last_token for rid in decode_ids], dtype=np.int64)
            routing_plan = table.routing_plan(np.concatenate([c.token_ids for c in prefill] + [last]))
        start = time.perf_counter()
        result = engine.step(list(prefill), list(decode_ids), routing_plan)
        sync()
        return time.perf_counter() - start, result

    runs = []
    for i in range(1 + PREFILL_REPEATS):  # the first one warms up
        runs.append(step([chunk(1000 + i, PREFILL_TOKENS)]))
        engine.clear()
    out = {
        "memory_plan": dict(engine.decoder.memory_plan()),
        "prefill": summarize(runs[1:], PREFILL_TOKENS, bytes_per_s, pick=min),
    }
    phases = [("decode", lambda rid: SamplingParams())]
    if temperature > 0:
        out["sampled_temperature"] = temperature
        phases.append(("decode_sampled", lambda rid: SamplingParams(temperature=temperature, seed=rid)))
    for phase, sampling in phases:
        out[phase] = {}
        for b in DECODE_BATCHES:
            ids = list(range(b))
            step([chunk(rid, DECODE_CONTEXT, sampling(rid)) for rid in ids])  # b x 128 <= max_batch_tokens
            for _ in range(WARMUP_STEPS):  # cuda: eager, capture, replay
                step(decode_ids=ids)
            runs = [step(decode_ids=ids) for _ in range(decode_steps)]
            out[phase][str(b)] = summarize(runs, b, bytes_per_s)
            if timeline and thread is not None and phase == "decode":
                out[phase][str(b)]["timeline"] = step_timeline(lambda: step(decode_ids=ids))
            if thread is not None and not use_plan:  # as bench/engine.py serves: graphs, two steps in flight
                seconds, _ = pipelined_decode(engine, ids, thread, lambda result, context: 0)
                out[phase][str(b)]["pipelined_tok_s"] = b / seconds
            engine.clear()
    return out


_THREADS: dict = {}


def _model_thread(engine: Engine):
    """The model thread pipelined decode runs on (cuda only; one per process)."""
    if engine.decoder.backend.value != "cuda":
        return None
    if "thread" not in _THREADS:
        from expert_service.serving.lifecycle import ModelThread

        _THREADS["thread"] = ModelThread("bench-offload")
    return _THREADS["thread"]


def device_name() -> str:
    if not cuda_available():
        return "cpu"
    from numba import cuda

    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)
