"""The expert cache against random routing traffic: many steps, uniform and skewed routing, both policies, every
prefetch mode, every slot count from 1 to E. A recording copy stream stands in for the copy engine and a shadow
of the slots is rebuilt from the copies alone, so each invariant is checked from what the cache does, not from
its own bookkeeping: no copy lands in a slot the running wave reads, a prefetch never evicts the step's experts
nor an earlier prediction, empty slots fill before anything is evicted, waves put residents first, and every
counter equals the count of the events it names."""

import numpy as np
import pytest

from expert_service.experts.cache import ExpertCache
from tests.expert_service.experts.test_expert_cache import FakeCopies


def block_nbytes(layer: int, expert: int) -> int:
    """Experts of different sizes (a layer may mix int8 and bf16 blocks): a copy must count its own block."""
    return 1000 + 10 * layer + expert


class Shadow:
    """What the slots hold and what the step has done, rebuilt from the copies issued; checks every copy."""

    def __init__(self, cache: ExpertCache, copies: FakeCopies):
        self.cache, self.copies, self.seen = cache, copies, 0
        self.target: dict[tuple[int, int], int] = {}  # (layer, slot) -> expert of its latest copy
        self.prefetched: set[tuple[int, int]] = set()  # slots filled by a prefetch not hit since
        self.expected = dict.fromkeys(("hits", "misses", "bytes", "issued", "used"), 0)

    def begin_step(self) -> None:
        self.step_experts = {layer: set() for layer in self.cache.layers}  # acquired or predicted this step

    def holds(self, layer: int) -> set[int]:
        return {e for (lay, _), e in self.target.items() if lay == layer}

    def take_copies(self, kind: str, in_use: set[int], layer_of_wave: int | None, still_needed=frozenset()):
        """The copies issued since the last call, all by `kind` ('demand' or 'prefetch')."""
        new = self.copies.issued[self.seen :]
        self.seen = len(self.copies.issued)
        for layer, expert, slot in new:
            held = self.holds(layer)
            assert expert not in held, f"layer {layer}: expert {expert} copied while a slot already holds it"
            evicted = self.target.get((layer, slot))
            if evicted is not None:  # empty slots are always taken before anything is evicted
                assert len(held) == self.cache.slots_per_layer, f"layer {layer}: evicted {evicted} with a slot empty"
            if layer == layer_of_wave:
                assert slot not in in_use, f"layer {layer}: a {kind} copy of {expert} into slot {slot} in use"
            if kind == "prefetch":
                assert evicted not in self.step_experts[layer], (
                    f"layer {layer}: a prefetch of {expert} evicted {evicted}, acquired or predicted this step"
                )
                self.prefetched.add((layer, slot))
                self.expected["issued"] += 1
            else:
                assert evicted not in still_needed, f"layer {layer}: a miss evicted {evicted}, needed later"
                self.prefetched.discard((layer, slot))
                self.expected["misses"] += 1
            self.target[(layer, slot)] = expert
            self.expected["bytes"] += block_nbytes(layer, expert)
        return new

    def prefetch(self, layer: int, experts: list[int], in_use=frozenset(), layer_of_wave=None) -> None:
        before = self.holds(layer)
        issued = self.cache.prefetch(layer, experts)
        new = self.take_copies("prefetch", set(in_use), layer_of_wave)
        assert issued == len(new)
        # what it brought in or found resident is this step's prediction (the rest was left alone)
        self.step_experts[layer] |= {e for _, e, _ in new} | (set(experts) & before)


def run_layer(shadow: Shadow, layer: int, experts: list[int], meddle=None) -> None:
    """Streams the layer wave by wave as the decoder does, checking each wave against the copies."""
    cache, copies = shadow.cache, shadow.copies
    distinct = list(dict.fromkeys(experts))
    resident_at_start = shadow.holds(layer) & set(distinct)
    computed: list[int] = []
    waves = cache.waves(layer, experts)
    for number, wave in enumerate(waves):
        remaining = set(distinct) - set(computed) - set(wave)
        demand = shadow.take_copies("demand", set(), None, remaining if meddle is None else frozenset())
        slots = set(wave.values())
        assert len(wave) <= cache.slots_per_layer and len(slots) == len(wave), "a slot given to two experts"
        assert {(e, s) for _, e, s in demand} <= set(wave.items()), "a demand copy outside the wave's slots"
        if meddle is None and number * cache.slots_per_layer < len(resident_at_start):
            # residents first: a wave holds misses only once every resident expert has had its wave
            assert not demand or len(computed) + len(wave) - len(demand) >= len(resident_at_start)
        copied = {s for _, _, s in demand}
        for s in wave.values():
            if s not in copied and (layer, s) in shadow.prefetched:
                shadow.expected["used"] += 1
            shadow.prefetched.discard((layer, s))
        shadow.expected["hits"] += len(wave) - len(demand)
        shadow.step_experts[layer] |= set(wave)
        if meddle is not None:
            meddle(layer, slots)
        copies.land_all()
        for e, s in wave.items():
            assert copies.contents[(layer, s)] == e, f"layer {layer}: expert {e} reads slot {s} holding another"
        computed += list(wave)
    assert sorted(computed) == sorted(distinct), "every needed expert computed exactly once"
    assert len(computed) == 0 or number + 1 == -(-len(distinct) // cache.slots_per_layer)


def routed(rng, num_experts: int, tokens: int, top_k: int, skew: np.ndarray | None) -> np.ndarray:
    return np.stack([rng.choice(num_experts, top_k, replace=False, p=skew) for _ in range(tokens)])


def skew_of(rng, num_experts: int, skewed: bool) -> np.ndarray | None:
    if not skewed:
        return None
    weights = rng.permutation(np.arange(num_experts, 0, -1.0) ** 2)
    return weights / weights.sum()


def drive(num_experts, slots, policy, prefetch, skewed, seed, steps=30, layers=(0, 2, 3), top_k=2):
    """`steps` steps of random routing through every layer, prefetching as the decoder does (plan: a noisy
    copy of the routing before the layer before it; lookahead: just before the previous layer's experts;
    adversarial: into the running layer and the next one between waves); checks the counters at every step."""
    rng = np.random.default_rng(seed)
    copies = FakeCopies()
    cache = ExpertCache(layers, num_experts, slots, block_nbytes, copies, policy=policy)
    shadow = Shadow(cache, copies)
    skew = {layer: skew_of(rng, num_experts, skewed) for layer in layers}
    for _ in range(steps):
        tokens = int(rng.integers(1, 7))
        ids = {layer: routed(rng, num_experts, tokens, top_k, skew[layer]) for layer in layers}
        cache.begin_step()
        shadow.begin_step()
        before = dict(shadow.expected)

        def predict(layer, ids=ids):
            noisy = ids[layer].copy()
            wrong = rng.random(noisy.shape) < 0.3
            noisy[wrong] = rng.integers(0, num_experts, int(wrong.sum()))
            return [int(e) for e in dict.fromkeys(noisy.reshape(-1).tolist())]

        if "plan" in prefetch:
            shadow.prefetch(layers[0], predict(layers[0]))
        for n, layer in enumerate(layers):
            following = layers[n + 1] if n + 1 < len(layers) else None
            if following is not None and "plan" in prefetch:
                shadow.prefetch(following, predict(following))
            if following is not None and "lookahead" in prefetch:
                shadow.prefetch(following, predict(following))
            meddle = None
            if "adversarial" in prefetch:

                def meddle(running, in_use, following=following):
                    shadow.prefetch(running, list(rng.permutation(num_experts)), in_use, running)
                    if following is not None:
                        shadow.prefetch(following, list(rng.permutation(num_experts)), in_use, running)

            run_layer(shadow, layer, ids[layer].reshape(-1).tolist(), meddle)
        stats = cache.end_step()
        got = (stats.hits, stats.misses, stats.bytes_copied, stats.prefetches_issued, stats.prefetches_used)
        want = tuple(shadow.expected[k] - before[k] for k in ("hits", "misses", "bytes", "issued", "used"))
        assert got == want, f"step counters (hits, misses, bytes, issued, used) {got}, copies say {want}"
        distinct = sum(len(set(v.reshape(-1).tolist())) for v in ids.values())
        assert stats.hits + stats.misses == distinct
    total = cache.total
    assert (total.hits, total.misses, total.prefetches_issued, total.prefetches_used) == (
        shadow.expected["hits"],
        shadow.expected["misses"],
        shadow.expected["issued"],
        shadow.expected["used"],
    )
    copies.land_all()
    for layer, state in cache.layers.items():  # the cache's map is what the copies left in the slots
        for expert, slot in state.slot_of.items():
            assert copies.contents[(layer, slot)] == expert


PREFETCH_MODES = ["none", "plan", "lookahead", "plan,lookahead", "adversarial", "plan,lookahead,adversarial"]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("prefetch", PREFETCH_MODES)
@pytest.mark.parametrize("skewed", [False, True])
def test_random_traffic_keeps_every_invariant_at_every_slot_count(policy, prefetch, skewed):
    num_experts = 6
    for slots in range(1, num_experts + 1):
        seed = [policy == "lfu", PREFETCH_MODES.index(prefetch), skewed, slots]
        drive(num_experts, slots, policy, prefetch, skewed, seed=seed)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_wide_layers_in_many_waves(policy):
    """16 experts, top-4 over up to 6 tokens: most steps need several waves even at half the experts."""
    for slots in (1, 3, 8, 15):
        drive(16, slots, policy, "plan,lookahead,adversarial", True, seed=slots, steps=20, top_k=4)


def test_lru_evicts_the_least_recently_used_expert():
    """One wave a step, no prefetch: each miss evicts, once the slots are full, the expert whose last use is the
    oldest among those the step does not use (a shadow LRU over the same uses: hits, then misses, in order)."""
    rng = np.random.default_rng(7)
    E, S = 8, 3
    copies = FakeCopies()
    cache = ExpertCache((0,), E, S, 1, copies, policy="lru")
    held: dict[int, int] = {}  # slot -> expert, from the copies
    last_use: dict[int, int] = {}
    for clock in range(0, 200 * E, E):
        experts = [int(e) for e in rng.choice(E, int(rng.integers(1, S + 1)), replace=False)]
        hits = [e for e in experts if e in held.values()]
        for n, e in enumerate(hits):
            last_use[e] = clock + n
        cache.begin_step()
        seen = len(copies.issued)
        cache.acquire(0, experts)
        for n, (_, expert, slot) in enumerate(copies.issued[seen:], start=len(hits)):
            if len(held) == S:
                oldest = min(set(held.values()) - set(experts), key=last_use.__getitem__)
                assert held[slot] == oldest, f"evicted {held[slot]}, the least recently used is {oldest}"
            held[slot] = expert
            last_use[expert] = clock + n
        cache.end_step()
