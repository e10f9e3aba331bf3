"""Functions shared by the tests, imported one way: ``from tests.helpers import ...``. Fixtures live in
tests/conftest.py (the CUDA simulator's pacing: tests/simulator.py).

- GPU: a GPU-only test is marked ``@pytest.mark.gpu``; tests/conftest.py skips it where ``has_gpu()`` is false.
- Storage dtypes: ``STORAGE_DTYPES`` (weights and KV pools: float32, float16, bfloat16 as uint16 words),
  ``to_storage`` / ``from_storage`` (through common.dtypes, as the model files do), ``random_weight``.
- Comparisons: ``assert_close`` for kernel outputs, ``rel_error`` for a figure to check or report.
- Kernel inputs: ``nan_device``, ``random_cache`` (paged KV), ``expert_buffer`` and ``random_ids`` (MoE),
  ``awkward_floats`` (16-bit rounding edge cases) with ``bf16_bits`` (the kernels' bfloat16 rounding).
- Text: ``byte_ids``; the one byte-level tokenizer is the tiny model's (``expert_service.tools.tiny_model``).
- Engines and services: ``run_session`` / ``exact_plans`` (expert cache), ``make_token_routed_model``,
  ``BackgroundWorker`` (an in-process worker) and ``running_router`` (an in-process router).
- Ports: ``free_port`` for a server that must be told its port up front (a child process, a port that 0 turns
  off); a server that can bind port 0 itself should, and report the port it got.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from ephemeral_port_reserve import reserve

from common.dtypes import bf16_to_float32, float32_to_bf16
from expert_service.tools.tiny_model import NUM_SPECIAL
from tests.grpc_teardown import grpc_tasks_ended

STORAGE_DTYPES = [np.float32, np.float16, np.uint16]  # uint16 = bfloat16 bits


# --- GPU ------------------------------------------------------------------------------------------------
def has_gpu() -> bool:
    """A usable NVIDIA GPU (never in Numba's CUDA simulator)."""
    from expert_service.backends import cuda_available

    return cuda_available()


# --- storage dtypes and comparisons ----------------------------------------------------------------------
def to_storage(x: np.ndarray, dtype) -> np.ndarray:
    """float32 -> storage dtype (bfloat16 as uint16 words, round to nearest even)."""
    return float32_to_bf16(x) if np.dtype(dtype) == np.uint16 else x.astype(dtype)


def from_storage(w: np.ndarray) -> np.ndarray:
    """Storage array -> the float32 values the kernels compute with."""
    return bf16_to_float32(w) if w.dtype == np.uint16 else w.astype(np.float32)


def random_weight(rng, shape, dtype, scale=1.0):
    """(storage array, its float32 values): the reference uses the rounded values, so only the kernel's
    accumulation order differs from it."""
    w = to_storage(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale), dtype)
    return w, from_storage(w)


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    """Every element written (finite) and max |got - want| <= rtol * max(|want|, 1) over the array."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} elements not written / not finite"
    err = float(np.max(np.abs(got.astype(np.float64) - want))) if got.size else 0.0
    scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1.0)
    assert err <= rtol * scale, f"max abs err {err:.3g} > {rtol} * {scale:.3g}"


def rel_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours - ref| relative to max |ref|."""
    return float(np.max(np.abs(ours - ref)) / max(np.max(np.abs(ref)), 1e-30))


# --- kernel inputs ---------------------------------------------------------------------------------------
def nan_device(shape, dtype=np.float32):
    """Device output pre-filled with NaN (or -1 for ints), so unwritten elements fail the comparison."""
    from numba import cuda

    fill = np.nan if np.dtype(dtype).kind == "f" else -1
    return cuda.to_device(np.full(shape, fill, dtype=dtype))


def random_cache(rng, context_lens, num_blocks_total, block_size, num_kv_heads, head_dim, dtype):
    """Pools full of random values and per-sequence block tables with shuffled, non-contiguous block ids.
    Returns (k_pool, v_pool, tables [S, max_blocks] int32, per-sequence int64 tables for the reference). Unused
    table entries hold a real block id, so a kernel that reads past a sequence's blocks gets wrong values."""
    shape = (num_blocks_total, block_size, num_kv_heads, head_dim)
    k_pool = to_storage(rng.standard_normal(shape, dtype=np.float32), dtype)
    v_pool = to_storage(rng.standard_normal(shape, dtype=np.float32), dtype)
    need = [-(-int(c) // block_size) for c in context_lens]
    max_blocks = max(max(need), 1) + 1  # one spare column: padding must be ignored
    ids = rng.permutation(num_blocks_total)
    assert sum(need) <= num_blocks_total
    tables = np.full((len(context_lens), max_blocks), num_blocks_total - 1, dtype=np.int32)
    lists, at = [], 0
    for s, n in enumerate(need):
        tables[s, :n] = ids[at : at + n]
        lists.append(tables[s, :n].astype(np.int64))
        at += n
    return k_pool, v_pool, tables, lists


def shared_cache(rng, prefixes, own_lens, block_size, num_kv_heads, head_dim):
    """Pools of random bf16 values and block tables: sequence i starts with the blocks of prefix prefixes[i] (a
    (name, keys) pair; sequences of the same name share those block ids) and owns own_lens[i] keys after them.
    Returns (k_pool, v_pool, tables [S, max_blocks] int32, context_lens [S] int32, per-sequence int64 tables)."""
    prefix_blocks, tables, lens, at = {}, [], [], 0
    for (name, keys), own in zip(prefixes, own_lens):
        assert keys % block_size == 0
        if name not in prefix_blocks:
            prefix_blocks[name] = list(range(at, at + keys // block_size))
            at += keys // block_size
        n_own = -(-own // block_size)
        tables.append(prefix_blocks[name] + list(range(at, at + n_own)))
        at += n_own
        lens.append(keys + own)
    total = at + 2
    ids = rng.permutation(total)  # shuffled, non-contiguous block ids
    shape = (total, block_size, num_kv_heads, head_dim)
    k_pool = to_storage(rng.standard_normal(shape, dtype=np.float32), np.uint16)
    v_pool = to_storage(rng.standard_normal(shape, dtype=np.float32), np.uint16)
    width = max(len(t) for t in tables) + 1
    table = np.full((len(tables), width), ids[-1], np.int32)  # unused entries: a real block, never to be read
    lists = []
    for i, t in enumerate(tables):
        table[i, : len(t)] = ids[t]
        lists.append(table[i, : len(t)].astype(np.int64))
    return k_pool, v_pool, table, np.asarray(lens, np.int32), lists


def check_decode_attention(
    launch, rng, context_lens, num_heads, num_kv_heads, head_dim, block_size, window, dtype, splits, rtol=1e-5, **kw
):
    """Runs a decode-attention launcher (launch_attention_decode's arguments, and its keywords kw) on a random paged
    cache, one query per sequence at its last position, split in at most `splits` parts, against the CPU
    paged_attention; sequences with context 0 (idle batch slots) must come out as zeros. Outputs and partials
    start as NaN."""
    from numba import cuda

    from expert_service.cpu.layers.attention import paged_attention

    num_seqs = len(context_lens)
    need = sum(-(-c // block_size) for c in context_lens)
    k_pool, v_pool, tables, lists = random_cache(rng, context_lens, need + 3, block_size, num_kv_heads, head_dim, dtype)
    q = rng.standard_normal((num_seqs, num_heads, head_dim), dtype=np.float32)
    ctx = np.asarray(context_lens, dtype=np.int32)
    positions = ctx - 1
    scale = head_dim**-0.5
    live = ctx > 0
    # The reference reads the same stored values, so only float32 arithmetic order differs.
    want = np.zeros_like(q)
    want[live] = paged_attention(
        q[live],
        from_storage(k_pool),
        from_storage(v_pool),
        np.arange(live.sum() + 1),
        ctx[live],
        [t for t, ok in zip(lists, live) if ok],
        positions[live],
        scale,
        window,
    )
    out = nan_device(q.shape)
    parts = [nan_device((num_seqs, num_heads, splits, n)) for n in (head_dim, 2)] if splits > 1 else [None, None]
    launch(
        cuda.to_device(q),
        cuda.to_device(k_pool),
        cuda.to_device(v_pool),
        cuda.to_device(tables),
        cuda.to_device(ctx),
        cuda.to_device(positions),
        window,
        scale,
        out,
        *parts,
        **kw,
    )
    assert_close(out.copy_to_host(), want, rtol)


def expert_buffer(rng, n_exp: int, F: int, D: int, dtype, scale: float = 0.3):
    """W [E, stride] in storage dtype `dtype` (stride = 4096-byte multiple, padding filled with NaN bits so a
    stray read shows) and the exact float32 values of each expert's (gate [F, D], up [F, D], down [D, F])."""
    store = np.dtype(dtype)
    stride = -(-3 * F * D * store.itemsize // 4096) * 4096 // store.itemsize
    words = to_storage((rng.standard_normal((n_exp, 3 * F * D)) * scale).astype(np.float32), store)
    exact = from_storage(words)
    W = np.full((n_exp, stride), 0x7FC1 if store == np.uint16 else np.nan, store)
    W[:, : 3 * F * D] = words
    mats = [(e[: F * D].reshape(F, D), e[F * D : 2 * F * D].reshape(F, D), e[2 * F * D :].reshape(D, F)) for e in exact]
    return W, mats


def random_ids(rng, n_tok: int, top_k: int, n_exp: int) -> np.ndarray:
    """[n_tok, top_k] int32 distinct expert ids per token."""
    return np.stack([rng.choice(n_exp, size=top_k, replace=False) for _ in range(n_tok)]).astype(np.int32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """The kernels' float32 -> bfloat16 rounding (numeric.f32_to_bf16) in numpy, as uint16 bits: nearest even, a
    NaN keeps its high bits and is made quiet (ml_dtypes agrees on every non-NaN value)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def awkward_floats(rng, shape) -> np.ndarray:
    """Random float32 normals (never zero) with the 16-bit roundings' edge cases scattered in: bfloat16 ties to
    even both ways, NaN, +-inf, float32 subnormals, the largest float32; float16 overflow to inf (65520) and
    just below it, the smallest normal and the largest subnormal, a subnormal tie to even."""
    x = rng.standard_normal(shape).astype(np.float32).reshape(-1)
    special = np.array(
        [
            0x3F808000,
            0x3F818000,
            0xBF808000,
            0x7FC00001,
            0xFF800001,
            0x7F800000,
            0xFF800000,
            0x00000001,
            0x80008000,
            0x7F7FFFFF,
            0x477FF000,
            0xC77FEFFF,
            0x38800000,
            0x387FC000,
            0x33C00000,
        ],
        np.uint32,
    ).view(np.float32)
    where = rng.choice(x.size, min(x.size, special.size), replace=False)
    x[where] = special[: where.size]
    return x.reshape(shape)


# --- text ------------------------------------------------------------------------------------------------
def random_prompt(seed: int, n: int, vocab: int = 259) -> list[int]:
    """n token ids drawn from the tiny models' non-special vocabulary, reproducible by seed."""
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def bf16_tiny(root: Path, family: str, seed: int, **overrides) -> Path:
    """The tiny model of `family` with HF config overrides (e.g. num_experts=40), converted to bf16."""
    from safetensors.numpy import save_file

    from expert_service.tools.convert import convert
    from expert_service.tools.tiny_model import tiny_hf_config, tiny_weights, write_tiny_checkpoint

    hf_dir = write_tiny_checkpoint(root / "hf", family, seed)
    hf = {**tiny_hf_config(family), **overrides}
    (hf_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_file(tiny_weights(hf, seed), str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return convert(hf_dir, root / "bf16", dtype="bfloat16", progress=False)


def byte_ids(text: str) -> list[int]:
    """Token ids of `text` under the tiny model's byte-level tokenizer: one token per UTF-8 byte."""
    return [NUM_SPECIAL + b for b in text.encode()]


# --- ports -----------------------------------------------------------------------------------------------
def outcome_unblocked(call, seconds: float = 10.0):
    """`call()`'s result or the exception it raised; a call still blocked after `seconds` (in open() on a FIFO, say)
    fails the test instead of hanging it."""
    out: list = []

    def run():
        try:
            out.append(call())
        except Exception as e:
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked opening a FIFO"
    return out[0]


def free_port() -> int:
    """A loopback port kept from other takers until a server binds it: it is left in TIME_WAIT, so the kernel
    hands it to no bind(0) or outgoing connection, while a server binding it with SO_REUSEADDR (gRPC, aiohttp,
    prometheus_client all do) gets it. A port merely closed could be taken by anyone before the server binds."""
    return reserve("127.0.0.1")


# --- engines and services --------------------------------------------------------------------------------
SESSION_PROMPTS = (np.arange(5, 29) % 250 + 3, np.array([7, 100, 42, 9, 9, 13, 200]))


def run_session(model, plans=None, backend="cpu", prompts=SESSION_PROMPTS, **overrides):
    """Prompts in one step, then 4 decodes, on a fresh engine (the expert-cache tests of both backends run the
    same steps at any cache size): (logits of every step, tokens, per-step cache stats, traces, engine)."""
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.engine.engine import PrefillInput
    from expert_service.engine.sampling import SamplingParams

    # the expert-cache tests prefetch in steps of every size (by default only steps whose tokens' experts fit the
    # slots do), so each prefetch source runs beside prefill chunks and batched decodes too
    overrides.setdefault("prefetch_large_steps", True)
    engine = build_engine(model, EngineConfig(backend=backend, kv_block_size=4, **overrides))
    greedy = SamplingParams()
    steps = [dict(prefill=[PrefillInput(i, p, greedy, True) for i, p in enumerate(prompts)])]
    steps += [dict(decode_ids=list(range(len(prompts))))] * 4
    logits, tokens, stats, traces = [], [], [], []
    for n, step in enumerate(steps):
        result = engine.step(**step, routing_plan=plans[n] if plans else None)
        logits.append(np.stack(list(result.logits)))
        tokens.append([o.token_id for o in result.outputs])
        stats.append(result.expert_cache)
        traces.append(result.trace)
    return logits, tokens, stats, traces, engine


def exact_plans(traces, num_experts=4):
    """The exact routing of each traced step as routing plans (CSR per MoE layer)."""
    from common.routing_plan import RoutingPlan

    return [
        RoutingPlan.from_expert_ids(list(trace.expert_ids), np.stack(list(trace.expert_ids.values())), num_experts)
        for trace in traces
    ]


def make_token_routed_model(tmp_path: Path, seed: int = 0, token_dims: int = 16) -> Path:
    """A tiny mixtral whose exact routing depends only on the token id, at every MoE layer.

    The first `token_dims` rows of every o_proj and expert down_proj are zero, so those residual dims carry
    the embedding unchanged into every layer; the router columns outside them are zero, so the gate sees
    only those dims. The post-attention RMSNorm multiplies them by a positive per-token scale (it depends
    on the context) times a fixed weight, and a positive scale never changes a top-k ranking.
    Mixtral has no shared expert or dense layer that could write into those dims. Returns the model dir.
    """
    from safetensors.numpy import load_file, save_file

    from common.models import config_from_hf, tensor_specs
    from expert_service.tools.convert import convert
    from expert_service.tools.tiny_model import write_tiny_checkpoint

    hf_dir = write_tiny_checkpoint(Path(tmp_path) / "token_routed_hf", "mixtral", seed)
    config = config_from_hf(json.loads((hf_dir / "config.json").read_text()))
    weights = load_file(str(hf_dir / "model.safetensors"))
    for spec in tensor_specs(config):
        leaf = spec.name.rsplit(".", 1)[-1]
        if leaf in ("o_proj", "down_proj"):  # [D, in]: rows are residual dims
            weights[spec.hf_name][:token_dims] = 0.0
        elif leaf == "router":  # [E, D]: columns are residual dims
            weights[spec.hf_name][:, token_dims:] = 0.0
    save_file(weights, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return convert(hf_dir, Path(tmp_path) / "token_routed", progress=False)


class BackgroundWorker:
    """Runs `expert_service.serving.main.serve` on its own event loop in a thread; `.address` once ready."""

    def __init__(
        self,
        model_dir: Path,
        port: int = 0,
        metrics_port: int = 0,
        tracer_provider=None,
        worker_overrides: dict | None = None,
        **engine_overrides,
    ):
        from common.tracing import make_tracer_provider
        from expert_service.engine.config import EngineConfig
        from expert_service.serving.main import WorkerConfig

        self.config = WorkerConfig(port=port, metrics_port=metrics_port, warmup_tokens=8, **(worker_overrides or {}))
        self.engine_config = EngineConfig(
            **{"backend": "cpu", "kv_block_size": 4, "kv_cache_tokens": 4096, **engine_overrides}
        )
        self.model_dir = model_dir
        self.loop = asyncio.new_event_loop()
        self.port: int | None = None
        self.exit_code: int | None = None
        self.servicer = None
        # A private provider unless a test brings one: the process-global one can be set only once.
        self.tracer_provider = tracer_provider or make_tracer_provider("test-worker")
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        from expert_service.serving.main import serve

        asyncio.set_event_loop(self.loop)

        def on_ready(port: int, servicer):
            self.port, self.servicer = port, servicer
            self._ready.set()

        async def main():
            self._stop = asyncio.Event()
            return await serve(
                str(self.model_dir),
                self.config,
                self.engine_config,
                stop=self._stop,
                on_ready=on_ready,
                tracer_provider=self.tracer_provider,
            )

        try:
            self.exit_code = self.loop.run_until_complete(main())
        finally:
            self._ready.set()

    def start(self) -> BackgroundWorker:
        self._thread.start()
        assert self._ready.wait(120), "worker did not start in time"
        assert self.port, f"worker failed to start (exit code {self.exit_code})"
        return self

    @property
    def engine(self):
        return self.servicer.engine

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> int | None:
        if self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        return self.exit_code


ROUTER_READY_TIMEOUT_S = 120.0  # connecting includes the worker's warm-up when asked for: seconds on a busy box


@contextlib.asynccontextmanager
async def running_router(worker_address: str, wait_ready: bool = True, **overrides):
    """Yields (router, GenerationService stub): an in-process router against `worker_address`, bound to a free
    loopback port, stopped after. No warm-up step unless a test passes warmup=True: the worker warmed up at
    its own start, and a second one only delays the test."""
    import grpc

    from common.pb import router_pb2_grpc
    from router_service.config import RouterConfig
    from router_service.main import start_router

    config = RouterConfig(
        **{"host": "127.0.0.1", "port": 0, "metrics_port": 0, "worker_retry_s": 0.05, "warmup": False, **overrides}
    )
    router = await start_router(config, worker_address)
    try:
        deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
        while wait_ready and not router.batching_loop.is_worker_ready and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert router.batching_loop.is_worker_ready or not wait_ready, (
            f"the router never connected to the worker at {worker_address} in {ROUTER_READY_TIMEOUT_S:.0f} s"
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            yield router, router_pb2_grpc.GenerationServiceStub(channel)
    finally:
        await router.stop(grace=0.1)
        await grpc_tasks_ended()


async def worker_kv_blocks_used(client) -> int:
    """KV blocks the worker holds, read through its FilterBatch RPC with nothing to keep from the unary calls
    (the router itself only uses the step stream, whose sequences FilterBatch leaves alone)."""
    from common.pb import worker_pb2

    response = await client._call(client._stub.FilterBatch, worker_pb2.FilterBatchRequest(), client.control_timeout_s)
    return response.kv_blocks_used


async def drained(router, engine=None, polls: int = 1000) -> None:
    """Waits (polls x 10 ms at most) until the router runs no request and the worker holds no KV block (and, given
    the worker's in-process `engine`, it holds no sequence and its pool no used block); then the router's
    scheduler must hold no block either."""
    loop = router.batching_loop
    for _ in range(polls):
        if loop.num_active == 0 and await worker_kv_blocks_used(router.worker) == 0:
            if engine is None or (not engine.sequences and engine.allocator.num_used_blocks == 0):
                assert loop.scheduler.num_used_blocks == 0
                return
        await asyncio.sleep(0.01)
    held = f"{loop.num_active} requests on the router, {await worker_kv_blocks_used(router.worker)} KV blocks on the worker"
    if engine is not None:
        held += f" ({len(engine.sequences)} sequences, {engine.allocator.num_used_blocks} blocks in its pool)"
    raise AssertionError(f"still held after the traffic: {held}")


def serve_command(model, port, *flags: str, backend: str = "cpu", metrics_port=0, worker_metrics_port=0) -> list[str]:
    """`colibri serve` on loopback for a test: the model, the public gRPC port, metrics ports (0: none), `flags`."""
    return [
        sys.executable, "-m", "colibri.cli", "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", str(metrics_port), "--worker-metrics-port", str(worker_metrics_port), "--backend", backend,
        *flags,
    ]  # fmt: skip


class LoggedProcess(subprocess.Popen):
    """A service run as a child, its stdout dropped and its stderr kept in a temporary file rather than a pipe: a
    pipe nobody reads fills at 64 KiB (the services log that much with the expert cache on cuda) and blocks the
    child mid-shutdown."""

    def __init__(self, cmd: list[str], env: dict[str, str]):
        self._stderr = tempfile.TemporaryFile()
        super().__init__(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self._stderr)

    def log(self, last: int = 3000) -> str:
        """The last `last` characters the child has written to stderr so far."""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-last:]


def serve_env(*without: str) -> dict[str, str]:
    """This process's environment for a served child: never the CUDA simulator, nor the variables named."""
    return {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM" and k not in without}


def exact_token_table(model, backend: str = "cpu"):
    """A token-routed model's exact routing table [L, V, K] uint16 (make_token_routed_model: routing depends on the
    token id alone, so tracing every id once in one prompt gives it), traced on a resident engine of `backend`."""
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.engine.engine import PrefillInput
    from expert_service.engine.sampling import SamplingParams

    cfg = model.config
    engine = build_engine(model, EngineConfig(backend=backend, kv_block_size=4, max_batch_tokens=cfg.vocab_size))
    try:
        vocab = np.arange(cfg.vocab_size, dtype=np.int64)
        trace = engine.step([PrefillInput(0, vocab, SamplingParams(), True)]).trace
    finally:
        engine.decoder.close()
    return np.stack([np.sort(trace.expert_ids[layer], axis=1) for layer in cfg.moe_layers]).astype(np.uint16)


def cpu_engine(model, config, overlap: bool):
    """An Engine on the cpu backend whose decoder takes part in overlapped steps as the cuda one does (`overlap`;
    off in production, where its launch runs the step at once)."""
    from expert_service.cpu.decoder import CpuDecoder
    from expert_service.engine.engine import Engine
    from expert_service.experts.slots import plan_slots

    slot_plan = plan_slots(model, config.expert_cache_gb, config.expert_cache_slots)
    return Engine(model, config, CpuDecoder(model, config, slot_plan, overlap=overlap))


def grpc_poller_of_a_closed_loop(record: logging.LogRecord) -> bool:
    """grpc.aio's completion-queue poller, bound to every event loop grpc has run on, waking an earlier test's loop
    (asyncio.run closed it) while this test runs: asyncio logs the failed callback. grpc's teardown across event
    loops (grpc/grpc#25364), not an error of the code under test."""
    return (
        record.name == "asyncio"
        and "PollerCompletionQueue._handle_events" in record.getMessage()
        and record.exc_info is not None
        and "Event loop is closed" in str(record.exc_info[1])
    )


def worth_reporting(record: logging.LogRecord) -> bool:
    """A record a test of error handling must not see: ERROR or worse, or any traceback, except grpc's poller of a
    closed loop."""
    return bool(record.levelno >= logging.ERROR or record.exc_info) and not grpc_poller_of_a_closed_loop(record)


class LogRecords(logging.Handler):
    """Keeps every record at `level` or above that reaches the loggers it is added to."""

    def __init__(self, level: int = logging.WARNING):
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def errors(self) -> list[str]:
        """The ERROR (and worse) records, as `logger: message`."""
        return [
            f"{r.name}: {r.getMessage()}"
            for r in self.records
            if r.levelno >= logging.ERROR and not grpc_poller_of_a_closed_loop(r)
        ]
