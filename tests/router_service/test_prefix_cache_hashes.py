"""PrefixCache.hashes with its memory of recent prompts: the hashes a prompt reuses from a recent one are those
computed from scratch, only the blocks past the shared whole blocks are hashed, salts never share, the memory
stays within its bounds, and a new index (the scheduler's clear on a worker reconnect) starts without it."""

from __future__ import annotations

import hashlib
import random
import struct
from types import SimpleNamespace

import pytest

from router_service import prefix_cache
from router_service.prefix_cache import PrefixCache, _RecentPrompts
from router_service.scheduler import ScheduledRequest, Scheduler, SchedulerLimits

VOCAB = 2**32  # ids are uint32: the top of the range exercises the byte order


def from_scratch(cache: PrefixCache, token_ids: list[int], salt: str = "") -> list[bytes]:
    """The chained block hashes by their definition (module docstring), with no memory."""
    parent = hashlib.sha256(cache.namespace + b"salt\0" + salt.encode()).digest() if salt else cache.namespace
    out, bs = [], cache.block_size
    for start in range(0, len(token_ids) - bs + 1, bs):
        parent = hashlib.sha256(parent + struct.pack(f"<{bs}I", *token_ids[start : start + bs])).digest()
        out.append(parent)
    return out


def fresh_rng() -> tuple[random.Random, int]:
    seed = random.randrange(2**32)  # fresh inputs each run; the seed is in every failure message
    return random.Random(seed), seed


def count_hashed_blocks(monkeypatch) -> list[int]:
    """Counts the sha256 digests prefix_cache computes (one per block hashed, plus a salted root)."""
    calls = [0]

    def sha256(data=b""):
        calls[0] += 1
        return hashlib.sha256(data)

    monkeypatch.setattr(prefix_cache, "hashlib", SimpleNamespace(sha256=sha256))
    return calls


@pytest.mark.parametrize("run", range(6))
def test_reused_hashes_equal_those_from_scratch(run):
    rng, seed = fresh_rng()
    block_size = rng.choice([1, 3, 4, 16])
    cache = PrefixCache(block_size, b"model")
    salts = ["", "", "tenant-a", "tenant-b"]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12 * block_size))]]
    for _ in range(300):
        base = rng.choice(prompts[-8:])  # mostly recent prompts, as a shared system prompt or a conversation
        shared = base[: rng.randrange(len(base) + 1)]  # any length: whole blocks, part of one, none, all
        tail = [rng.randrange(VOCAB) for _ in range(rng.randrange(3 * block_size))]
        prompt = shared + tail or [rng.randrange(VOCAB)]
        prompts.append(prompt)
        salt = rng.choice(salts)
        got = cache.hashes(prompt, salt)
        assert got == from_scratch(cache, prompt, salt), f"seed {seed}"
        assert got == PrefixCache(block_size, b"model").hashes(prompt, salt), f"seed {seed}"


def test_a_prompt_hashes_only_the_blocks_past_what_it_shares(monkeypatch):
    rng, seed = fresh_rng()
    cache = PrefixCache(16, b"model")
    system = [rng.randrange(VOCAB) for _ in range(2048)]
    first = system + [rng.randrange(VOCAB) for _ in range(64)]
    cache.hashes(first)
    calls = count_hashed_blocks(monkeypatch)
    second = system + [rng.randrange(VOCAB) for _ in range(64)]
    assert cache.hashes(second) == from_scratch(cache, second), f"seed {seed}"
    assert calls[0] == 4, f"seed {seed}"  # its own 64 tokens; the 128 blocks of the system prompt are reused
    calls[0] = 0
    cut = rng.randrange(16, 2048)  # a prompt sharing part of a block: that block and the rest are hashed
    third = system[:cut] + [(t + 1) % VOCAB for t in system[cut:]]
    assert cache.hashes(third) == from_scratch(cache, third), f"seed {seed}"
    assert calls[0] == 128 - cut // 16, f"seed {seed} cut {cut}"
    calls[0] = 0
    assert cache.hashes(third + [7] * 15) == from_scratch(cache, third), f"seed {seed}"  # no new full block
    assert calls[0] == 0, f"seed {seed}"


def test_salts_never_share(monkeypatch):
    rng, seed = fresh_rng()
    cache = PrefixCache(4, b"model")
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(4, 64))]
    by_salt = {salt: cache.hashes(prompt, salt) for salt in ("", "a", "b")}
    for salt, hashes in by_salt.items():
        assert hashes == from_scratch(cache, prompt, salt), f"seed {seed}"
    assert len(set().union(*map(set, by_salt.values()))) == 3 * (len(prompt) // 4), f"seed {seed}"
    assert len(cache._recent) == 3  # one memory per salt
    calls = count_hashed_blocks(monkeypatch)
    assert cache.hashes(prompt, "c") == from_scratch(cache, prompt, "c"), f"seed {seed}"
    assert calls[0] == 1 + len(prompt) // 4  # the salted root and every block: nothing reused across salts


def test_prompts_shorter_than_a_block(monkeypatch):
    cache = PrefixCache(16, b"model")
    assert cache.hashes([]) == []
    assert cache.hashes(list(range(15)), "salt") == []
    assert len(cache._recent) == 0  # nothing to remember
    block = list(range(16))
    assert cache.hashes(block) == from_scratch(cache, block)
    calls = count_hashed_blocks(monkeypatch)
    assert cache.hashes(block[:15]) == []
    assert cache.hashes(block) == from_scratch(cache, block)
    assert calls[0] == 0


def test_the_memory_keeps_the_latest_prompts_within_its_bounds():
    rng, seed = fresh_rng()
    cache = PrefixCache(4, b"model")
    cache._recent = _RecentPrompts(max_prompts=4)
    prompts = [[i, *(rng.randrange(VOCAB) for _ in range(rng.randrange(4, 40)))] for i in range(10)]
    for prompt in prompts:
        cache.hashes(prompt)
    assert len(cache._recent) == 4
    cache.hashes(prompts[6])  # hashed again: the most recent now
    cache.hashes(prompts[0])  # forgotten, hashed again: pushes out the least recently hashed, 7
    firsts = [key[1][:4] for key in cache._recent._prompts]
    assert firsts == [struct.pack("<I", i) for i in (8, 9, 6, 0)], f"seed {seed}"
    assert cache._recent.num_bytes == sum(p.num_bytes for p in cache._recent._prompts.values())

    cache._recent = _RecentPrompts(max_bytes=1000)
    long = [rng.randrange(VOCAB) for _ in range(400)]  # 1,600 bytes alone: over the bound, kept as the latest
    for prompt in prompts[:3] + [long]:
        cache.hashes(prompt)
    assert len(cache._recent) == 1 and cache._recent.num_bytes > 1000
    cache.hashes(prompts[3])
    assert len(cache._recent) == 1  # the long one goes once another is the latest
    for prompt in prompts + [long]:
        assert cache.hashes(prompt) == from_scratch(cache, prompt), f"seed {seed}"


def test_a_new_index_starts_without_the_memory(monkeypatch):
    rng, seed = fresh_rng()
    scheduler = Scheduler(SchedulerLimits(4, 64, 16, 64), PrefixCache(16, b"model"))
    prompt = [rng.randrange(VOCAB) for _ in range(100)]
    scheduler.add(ScheduledRequest(1, prompt, max_new_tokens=1))
    old = scheduler.prefix_cache
    assert len(old._recent) == 1
    scheduler.clear()  # the worker was lost: a new index, and no memory of the prompts hashed before
    new = scheduler.prefix_cache
    assert new is not old and len(new._recent) == 0
    calls = count_hashed_blocks(monkeypatch)
    scheduler.add(ScheduledRequest(2, prompt, max_new_tokens=1))
    assert scheduler.requests[2].prefix.hashes == from_scratch(new, prompt), f"seed {seed}"
    assert calls[0] == 100 // 16  # every block hashed again


def test_given_token_bytes_hash_as_the_ids_do():
    """The bytes validation made (ValidatedRequest.prompt_bytes) stand for the ids: the same hashes, recent
    prompts included, and the index remembers them as it would the ids'."""
    rng, seed = fresh_rng()
    system = [rng.randrange(VOCAB) for _ in range(64)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(rng.randrange(40))] for _ in range(6)]
    by_ids, by_bytes = PrefixCache(16, b"model"), PrefixCache(16, b"model")
    for prompt in prompts:
        data = struct.pack(f"<{len(prompt)}I", *prompt)
        assert by_bytes.hashes(prompt, "s", data) == by_ids.hashes(prompt, "s") == from_scratch(by_ids, prompt, "s"), (
            f"seed {seed}"
        )
