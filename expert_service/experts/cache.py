"""The expert cache's bookkeeping, as pure host-side logic: a fixed number of expert slots per MoE layer over the
full host copy of the experts. Neither backend's memory lives here: a backend's *copy engine* owns the slots and
moves an expert's contiguous block into one (cpu: ``experts.host_copy.HostCopyEngine``; cuda:
``cuda.expert_slots.DeviceSlots``).

Design note. A slot is in one of three states: empty, pending (a copy was issued and may still be running)
or ready. A step marks the slots it computes with as *in use* from `acquire` to `release`; a victim is only
ever chosen among slots not in use, so a running step never has its weights overwritten (a prefetch that
evicts an expert the step is still reading would corrupt its output). Copies complete in issue order (one
copy stream), so a slot re-targeted while a copy into it is pending ends up with the latest expert, and
waiting on the latest copy suffices. A layer that needs more distinct experts than it has slots is run in
*waves* (`stream`): resident experts first (so no miss evicts an expert that is needed later in the same
step), each wave computed and released before the next is loaded. Each needed expert is acquired once per
step, whatever the number of tokens routed to it (batch-level union).

Accounting (per step and cumulative): a *hit* is a needed expert already resident or pending in a slot
(a pending prefetch is a hit whose remaining copy time shows up as stall); a *miss* needs a copy issued
by `acquire`. hits + misses = distinct experts per layer per step. ``bytes_copied`` counts every copy,
demand and prefetch, in stored bytes: each copied expert's own block (an int8 expert's bytes and scales, not
the largest block of its layer). A prefetch is *used* when a later `acquire` hits the expert it brought in.
``stall_seconds`` is the time compute waited on copies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Protocol

EMPTY = -1


class CopyHandle(Protocol):
    def result(self) -> object:
        """Blocks until the copy landed."""


class CopyEngine(Protocol):
    """Moves expert weights into slots. Copies must complete in issue order (one copy stream)."""

    def copy(self, layer: int, expert: int, slot: int) -> CopyHandle:
        """Starts copying `expert` of `layer` into `slot`; returns a handle with `.result()` (blocks until done)."""


class ReplacementPolicy(Protocol):
    """Chooses victims among a layer's evictable slots; told about every fill (which expert a slot now holds) and
    every touch: a use by the step, or a prediction (`use=False`: recent, but not used)."""

    def filled(self, layer: int, slot: int, expert: int) -> None: ...

    def touch(self, layer: int, slot: int, use: bool = True) -> None: ...

    def victim(self, layer: int, candidates: list[int]) -> int: ...


class LruPolicy:
    """Least recently used: a global tick per touch; the candidate with the oldest tick goes."""

    def __init__(self) -> None:
        self._tick = 0
        self._last: dict[tuple[int, int], int] = {}

    def filled(self, layer: int, slot: int, expert: int) -> None:
        pass

    def touch(self, layer: int, slot: int, use: bool = True) -> None:
        self._tick += 1
        self._last[(layer, slot)] = self._tick

    def victim(self, layer: int, candidates: list[int]) -> int:
        return min(candidates, key=lambda s: self._last.get((layer, s), 0))


class LfuPolicy(LruPolicy):
    """Least frequently used, with aging: each (layer, expert) counts its uses, resident or not, and a layer's
    counts halve every `half_life` uses of that layer, so an expert that was hot long ago gives way; the victim is
    the candidate whose expert counts least, the least recently used among equals. Learned routing favours some
    experts for long stretches, which LRU forgets at the first few misses of others (docs/expert-cache.md).
    Predictions count no use (as on the device): a wrong prediction made every step must not outlive real uses."""

    def __init__(self, half_life: int = 64) -> None:
        super().__init__()
        self.half_life = half_life
        self._expert: dict[tuple[int, int], int] = {}  # (layer, slot) -> the expert it holds
        self._count: dict[int, dict[int, float]] = {}  # layer -> expert -> aged use count
        self._uses: dict[int, int] = {}  # layer -> uses so far

    def filled(self, layer: int, slot: int, expert: int) -> None:
        self._expert[(layer, slot)] = expert

    def touch(self, layer: int, slot: int, use: bool = True) -> None:
        super().touch(layer, slot)
        if not use:
            return
        counts = self._count.setdefault(layer, {})
        uses = self._uses[layer] = self._uses.get(layer, 0) + 1
        if uses % self.half_life == 0:
            for expert in counts:
                counts[expert] *= 0.5
        expert = self._expert[(layer, slot)]
        counts[expert] = counts.get(expert, 0.0) + 1.0

    def victim(self, layer: int, candidates: list[int]) -> int:
        counts = self._count.get(layer, {})
        return min(
            candidates,
            key=lambda s: (counts.get(self._expert.get((layer, s), -1), 0.0), self._last.get((layer, s), 0)),
        )


POLICIES = {"lru": LruPolicy, "lfu": LfuPolicy}
# what the cuda backend's slot-map kernel implements (cuda/expert_slots.py maps each to its kernel's argument)
DEVICE_POLICIES = ("lru", "lfu")


@dataclass(frozen=True, slots=True)
class CacheStats:
    hits: int = 0  # needed experts found resident or pending in a slot
    misses: int = 0  # needed experts that had to be copied when the step asked for them
    bytes_copied: int = 0  # stored bytes of every copy issued (demand + prefetch)
    prefetches_issued: int = 0  # copies issued by `prefetch`
    prefetches_used: int = 0  # prefetched experts that a later `acquire` hit
    stall_seconds: float = 0.0  # time compute waited on copies

    def __add__(self, other: CacheStats) -> CacheStats:
        return CacheStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


class _Counters:
    """CacheStats being counted (one step's, or the whole run's): the same fields, mutable."""

    __slots__ = ("hits", "misses", "bytes_copied", "prefetches_issued", "prefetches_used", "stall_seconds")

    def __init__(self) -> None:
        self.hits = self.misses = self.bytes_copied = self.prefetches_issued = self.prefetches_used = 0
        self.stall_seconds = 0.0

    def freeze(self) -> CacheStats:
        # by name: the two field lists cannot pair up out of order (a test holds them equal)
        return CacheStats(**{name: getattr(self, name) for name in self.__slots__})


class _Layer:
    """One MoE layer's slots."""

    def __init__(self, num_slots: int):
        self.expert = [EMPTY] * num_slots  # expert held (or being copied) by each slot
        self.pending: list[CopyHandle | None] = [None] * num_slots  # handle of the latest copy, until waited on
        self.prefetched = [False] * num_slots  # filled by a prefetch not yet hit
        self.in_use: set[int] = set()  # slots the running step computes with
        self.protected: set[int] = set()  # slots acquired or prefetched during this step
        self.slot_of: dict[int, int] = {}  # expert -> slot


class ExpertCache:
    def __init__(
        self,
        moe_layers: Iterable[int],
        num_experts: int,
        slots_per_layer: int,
        expert_nbytes: int | Callable[[int, int], int],
        copy_engine: CopyEngine,
        policy: str | ReplacementPolicy = "lru",
    ):
        if slots_per_layer < 1:
            raise ValueError(f"slots_per_layer must be >= 1, got {slots_per_layer}")
        self.num_experts = num_experts
        self.slots_per_layer = slots_per_layer
        # one size for every expert, or (layer, expert) -> its stored block: a layer may mix int8 and bf16 experts
        self.block_nbytes = expert_nbytes if callable(expert_nbytes) else lambda layer, expert: expert_nbytes
        self.copy_engine = copy_engine
        self.policy: ReplacementPolicy = POLICIES[policy]() if isinstance(policy, str) else policy
        self.layers = {layer: _Layer(slots_per_layer) for layer in moe_layers}
        self._step = _Counters()
        self.total = CacheStats()

    # --- step boundaries ----------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._step = _Counters()
        for state in self.layers.values():
            state.in_use.clear()
            state.protected.clear()

    def end_step(self) -> CacheStats:
        """The step's counts (also added to `total`); releases anything still in use."""
        for layer in self.layers:
            self.release(layer)
        stats = self._step.freeze()
        self.total = self.total + stats
        self._step = _Counters()
        return stats

    # --- the step's experts -------------------------------------------------------------------------
    def acquire(self, layer: int, experts: Iterable[int], wait: bool = True) -> dict[int, int]:
        """Slots for `experts` (distinct, at most slots_per_layer not counting those already in use), marked in
        use until `release(layer)`. Hits keep their slot; misses are copied into victims chosen by the policy
        among slots not in use. With `wait`, blocks until every copy landed (else call `wait`)."""
        state, experts = self.layers[layer], list(dict.fromkeys(int(e) for e in experts))
        misses = [e for e in experts if e not in state.slot_of]
        free = [s for s in range(self.slots_per_layer) if s not in state.in_use]
        if len(experts) - sum(state.slot_of.get(e) in state.in_use for e in experts) > len(free):
            raise ValueError(
                f"layer {layer}: {len(experts)} experts do not fit {len(free)} free slots "
                f"(use stream() to run them in waves)"
            )
        slots: dict[int, int] = {}
        for e in experts:  # hits first: mark them in use before any victim is chosen
            if e in state.slot_of:
                slot = slots[e] = state.slot_of[e]
                self._step.hits += 1
                if state.prefetched[slot]:
                    state.prefetched[slot] = False
                    self._step.prefetches_used += 1
                self._claim(layer, state, slot)
        for e in misses:
            slot = slots[e] = self._victim(layer, state, exclude=state.in_use)
            self._fill(layer, state, slot, e)
            self._step.misses += 1
            self._claim(layer, state, slot)
        if wait:
            for slot in slots.values():
                self.wait(layer, slot)
        return slots

    def wait(self, layer: int, slot: int) -> None:
        """Blocks until the slot's latest copy landed; the wait is stall time."""
        state = self.layers[layer]
        handle = state.pending[slot]
        if handle is not None:
            started = time.perf_counter()
            handle.result()
            self._step.stall_seconds += time.perf_counter() - started
            state.pending[slot] = None

    def release(self, layer: int) -> None:
        self.layers[layer].in_use.clear()

    def stream(self, layer: int, experts: Iterable[int]) -> Iterator[tuple[int, int]]:
        """Yields (expert, slot) with the slot's weights ready, for every expert of the step in this layer, in
        waves of at most slots_per_layer; a wave's slots stay valid until the item after its last is asked
        for. Resident experts come first (waited on in copy order), then misses, so copies overlap compute."""
        for wave in self.waves(layer, experts):
            yield from wave.items()

    def waves(self, layer: int, experts: Iterable[int]) -> Iterator[dict[int, int]]:
        """The same in whole waves: {expert: slot}, each slot waited on (`wait`) before the wave is yielded,
        and released when the next wave is asked for."""
        state = self.layers[layer]
        experts = list(dict.fromkeys(int(e) for e in experts))
        experts.sort(key=lambda e: e not in state.slot_of)  # stable: residents first
        size = self.slots_per_layer
        for start in range(0, len(experts), size):
            wave = self.acquire(layer, experts[start : start + size], wait=False)
            for slot in wave.values():
                self.wait(layer, slot)
            yield wave
            self.release(layer)

    def add_stall(self, seconds: float) -> None:
        """Stall measured by the backend where `wait` does not block the host (the GPU's compute stream waits
        on copy events; the time is read from timing events after the step)."""
        self._step.stall_seconds += seconds

    # --- prefetch -----------------------------------------------------------------------------------
    def prefetch(self, layer: int, experts: Iterable[int]) -> int:
        """Issues copies for predicted experts (in priority order) without waiting; returns how many were
        issued. Only slots neither in use nor acquired/prefetched during this step are taken, so a prefetch
        never evicts the running step's weights nor an earlier prediction for it."""
        state, issued = self.layers[layer], 0
        for e in dict.fromkeys(int(e) for e in experts):
            if e in state.slot_of:  # already there: keep it for this step
                slot = state.slot_of[e]
                state.protected.add(slot)
                self.policy.touch(layer, slot, use=False)
                continue
            blocked = state.in_use | state.protected
            if len(blocked) >= self.slots_per_layer:
                break
            slot = self._victim(layer, state, exclude=blocked)
            self._fill(layer, state, slot, e)
            state.prefetched[slot] = True
            state.protected.add(slot)
            self.policy.touch(layer, slot, use=False)
            self._step.prefetches_issued += 1
            issued += 1
        return issued

    # --- internals ----------------------------------------------------------------------------------
    def _victim(self, layer: int, state: _Layer, exclude: set[int]) -> int:
        candidates = [s for s in range(self.slots_per_layer) if s not in exclude]
        empty = [s for s in candidates if state.expert[s] == EMPTY]
        return empty[0] if empty else self.policy.victim(layer, candidates)

    def _fill(self, layer: int, state: _Layer, slot: int, expert: int) -> None:
        old = state.expert[slot]
        if old != EMPTY:
            del state.slot_of[old]
        state.expert[slot], state.slot_of[expert] = expert, slot
        self.policy.filled(layer, slot, expert)
        state.prefetched[slot] = False
        state.pending[slot] = self.copy_engine.copy(layer, expert, slot)
        self._step.bytes_copied += self.block_nbytes(layer, expert)

    def _claim(self, layer: int, state: _Layer, slot: int) -> None:
        state.in_use.add(slot)
        state.protected.add(slot)
        self.policy.touch(layer, slot)
