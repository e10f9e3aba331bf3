"""Host cost of prefix caching, no model and no sockets: what the router and the worker spend on it besides the
device steps, and how many steps a request waits for its first token.

1. hashing: PrefixCache.hashes of one S+U-token prompt (the router runs it on its event loop as a request is
   added), against the previous numpy conversion (reference).
2. registrations: the worker's cache_registrations for one max_batch_tokens chunk (every block registered),
   against the previous pairwise check of a step's new keys (reference).
3. traffic: serve_prefix's shared and unshared rounds (N clients, S-token system prompt shared or not, U-token
   user turns, G new tokens) through the real Scheduler, two steps in flight as the batching loop sends them,
   answered at once; the worker's pool (BlockAllocator) follows every step as the engine does. Per round, caching
   on (prompts' and generated blocks, the default), on for prompts' blocks only, and off: the router's scheduler
   time (add, schedule, update), the worker's block bookkeeping (registrations of generated blocks checked as the
   step stream checks them), steps, prompt tokens computed, p50 of the step that brings a request's first token
   (TTFT in steps), and generated blocks cached.

    python bench/prefix_host.py --out bench/results/cpu-prefix-host.json
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BLOCK = 16


def _median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


def _hashes_numpy(namespace: bytes, token_ids: list[int]) -> list[bytes]:
    """The previous PrefixCache.hashes: the prompt through numpy."""
    parent, data, width, out = namespace, np.asarray(token_ids, "<u4").tobytes(), 4 * BLOCK, []
    for start in range(0, len(data) - width + 1, width):
        parent = hashlib.sha256(parent + data[start : start + width]).digest()
        out.append(parent)
    return out


def _registrations_pairwise(ids: tuple[int, ...], cached: dict) -> list:
    """The previous check of a chunk's new keys: each against those before it."""
    out: list = []
    for index, block_id in enumerate(ids):
        key = (0, block_id)
        if key in cached or any(key == k for _, _, k in out):
            raise ValueError(block_id)
        out.append((1, index, key))
    return out


def host_costs(prompt_tokens: int, chunk_tokens: int, reps: int) -> dict:
    from expert_service.engine.kv_cache import BlockAllocator
    from expert_service.engine.prefix_blocks import cache_registrations
    from expert_service.engine.step import PrefillInput
    from router_service.prefix_cache import PrefixCache

    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 32000, prompt_tokens).tolist()
    cache = PrefixCache(BLOCK, b"bench")
    assert cache.hashes(tokens) == _hashes_numpy(cache.namespace, tokens)
    pool = BlockAllocator(chunk_tokens // BLOCK + 1, BLOCK)
    pool.ensure_capacity(1, chunk_tokens)
    ids = tuple(range(1, chunk_tokens // BLOCK + 1))
    chunk_ids = rng.integers(3, 32000, chunk_tokens)  # its own tokens: a chunk may be longer than one prompt
    chunk = PrefillInput(1, chunk_ids, None, False, cache_block_ids=ids)

    new = cache_registrations(pool, {1: _Seq()}, [chunk], 0)
    assert new == _registrations_pairwise(ids, pool.cached)
    return {
        "hash_us": _median_us(lambda: cache.hashes(tokens), reps),
        "hash_reference_us": _median_us(lambda: _hashes_numpy(cache.namespace, tokens), reps),
        "registrations_us": _median_us(lambda: cache_registrations(pool, {1: _Seq()}, [chunk], 0), reps),
        "registrations_reference_us": _median_us(lambda: _registrations_pairwise(ids, pool.cached), reps),
    }


class _Seq:
    """What the worker's registration checks read of a sequence: its cached token count."""

    def __init__(self, num_cached: int = 0):
        self.num_cached = num_cached


class _Worker:
    """The worker's pool as the engine drives it (frees, evictions, attach, capacity, registrations of chunks'
    blocks and of blocks running sequences' decodes filled, checked as the step stream checks them), timed."""

    def __init__(self, num_blocks: int):
        from expert_service.engine.kv_cache import BlockAllocator

        self.pool, self.seqs, self.seconds = BlockAllocator(num_blocks, BLOCK), {}, 0.0

    def run(self, step) -> None:
        from expert_service.engine.prefix_blocks import sequence_block_registrations

        start = time.perf_counter()
        for rid in step.free_ids:
            self.pool.free(rid)
            self.seqs.pop(rid, None)
        for block_id in step.evict_block_ids:
            self.pool.evict((0, block_id))
        registrations = []
        if step.sequence_blocks:  # checked before the launch, against the tokens this step feeds
            rows = np.asarray(step.sequence_blocks, "<u8").reshape(-1, 3)
            fed = dict.fromkeys(step.decode_ids, 1)
            registrations = sequence_block_registrations(self.pool, self.seqs, rows, 0, lambda r: True, fed)
        for chunk in step.prefill_chunks:
            rid = chunk.request_id
            if chunk.is_first:
                keys = [(0, b) for b in chunk.prefix_block_ids]
                self.pool.check_attach(keys)
                if keys:
                    self.pool.attach(rid, keys)
                self.seqs[rid] = _Seq(len(keys) * BLOCK)
            begin = self.seqs[rid].num_cached
            self.pool.ensure_capacity(rid, begin + len(chunk.token_ids))
            for index, block_id in enumerate(chunk.cache_block_ids, begin // BLOCK):
                if block_id:
                    self.pool.register(rid, index, (0, block_id))
            self.seqs[rid].num_cached = begin + len(chunk.token_ids)
        for rid in step.decode_ids:
            self.pool.ensure_capacity(rid, self.seqs[rid].num_cached + 1)
            self.seqs[rid].num_cached += 1
        for seq_id, index, key in registrations:  # after the launch, as the step stream registers them
            self.pool.register(seq_id, index, key)
        self.seconds += time.perf_counter() - start


def traffic(caching: bool, shared: bool, args, generated: bool = True) -> dict:
    """serve_prefix's rounds through the scheduler; medians over the rounds after the first. generated: the
    running requests' filled blocks are cached too (the worker's InfoResponse.caches_generated_blocks)."""
    from router_service.prefix_cache import PrefixCache
    from router_service.scheduler import RequestOutput, ScheduledRequest, Scheduler, SchedulerLimits

    per_request = args.system_tokens + args.user_tokens + args.new_tokens
    num_blocks = (3 * 32 * per_request + args.max_batch_tokens) // BLOCK  # serve_prefix's pool
    limits = SchedulerLimits(64, args.max_batch_tokens, BLOCK, num_blocks)
    scheduler = Scheduler(limits, PrefixCache(BLOCK, b"bench", generated) if caching else None)
    worker, rng, ids, rounds = _Worker(num_blocks), np.random.default_rng(1), iter(range(1, 1 << 30)), []
    for _ in range(args.rounds + 1):
        router_s, worker_before, steps, computed, first, generated = 0.0, worker.seconds, 0, 0, [], 0
        system = rng.integers(3, 32000, args.system_tokens).tolist()
        start = time.perf_counter()
        for _ in range(args.clients):
            prefix = system if shared else rng.integers(3, 32000, args.system_tokens).tolist()
            prompt = prefix + rng.integers(3, 32000, args.user_tokens).tolist()
            scheduler.add(ScheduledRequest(next(ids), prompt, args.new_tokens))
        router_s += time.perf_counter() - start
        in_flight: collections.deque = collections.deque()
        while scheduler.requests or in_flight:
            start = time.perf_counter()
            while len(in_flight) < 2:
                step = scheduler.schedule()
                if step.is_empty and not step.free_ids and not step.evict_block_ids:
                    break
                in_flight.append(step)  # frees and evictions go out even with nothing to run, as the loop does
                generated += len(step.sequence_blocks)
                if step.is_empty:
                    break
            router_s += time.perf_counter() - start
            if not in_flight:
                break
            step = in_flight.popleft()
            worker.run(step)
            steps += not step.is_empty
            outputs = []
            for chunk in step.prefill_chunks:
                computed += len(chunk.token_ids)
                outputs.append(RequestOutput(chunk.request_id, 5 if chunk.is_last else None))
                first += [steps] if chunk.is_last else []
            outputs += [RequestOutput(rid, 5) for rid in step.decode_ids]
            start = time.perf_counter()
            scheduler.update(step, outputs)
            router_s += time.perf_counter() - start
        rounds.append(
            {
                "router_ms": router_s * 1e3,
                "worker_ms": (worker.seconds - worker_before) * 1e3,
                "steps": steps,
                "prompt_tokens_computed": computed,
                "first_token_step_p50": float(np.median(first)),
                "generated_blocks_cached": generated,
            }
        )
    return {key: float(np.median([r[key] for r in rounds[1:]])) for key in rounds[0]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/prefix_host.json")
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args(argv)
    costs = host_costs(args.system_tokens + args.user_tokens, args.max_batch_tokens, args.reps)
    print(f"one prompt's block hashes ({args.system_tokens + args.user_tokens} tokens) ")
    print(f"  {costs['hash_us']:8.1f} us, reference {costs['hash_reference_us']:8.1f} us")
    print(f"worker registrations of a {args.max_batch_tokens}-token chunk")
    print(f"  {costs['registrations_us']:8.1f} us, reference {costs['registrations_reference_us']:8.1f} us")
    results: dict = {"host": costs}
    columns = ("router_ms", "worker_ms", "steps", "computed", "ttft", "generated")
    print(f"{'per round':28s}" + "".join(f"{k:>24s}" for k in columns))
    # on: prompts' and generated blocks cached (the default); on_prompts: prompts' blocks only; off: no caching
    settings = {"on": (True, True), "on_prompts": (True, False), "off": (False, False)}
    for name in ("shared", "unshared"):
        for setting, (caching, generated) in settings.items():
            row = traffic(caching, name == "shared", args, generated)
            results[f"{name}_{setting}"] = row
            print(f"{name + ' ' + setting:28s}" + "".join(f"{v:24.2f}" for v in row.values()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: getattr(args, k) for k in vars(args) if k != "out"}
    record = {"benchmark": "prefix-host", "cpu": platform.processor() or platform.machine(), "config": config}
    out.write_text(json.dumps(record | {"results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
