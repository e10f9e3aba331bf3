"""BatchingLoop pieces that need no worker: the prefix cache's counters as the metrics hooks receive them."""

from router_service.batching_loop import BatchingLoop
from router_service.config import RouterConfig
from router_service.observability import BatchingLoopHooks
from router_service.prefix_cache import PrefixCache
from router_service.scheduler import Scheduler, SchedulerLimits

LIMITS = SchedulerLimits(max_batch_size=4, max_batch_tokens=16, kv_block_size=4, num_kv_blocks=16)


class Reported(BatchingLoopHooks):
    def __init__(self):
        self.calls: list[tuple[int, int, int]] = []

    def on_prefix_cache(self, query_tokens: int, hit_tokens: int, evicted_blocks: int) -> None:
        self.calls.append((query_tokens, hit_tokens, evicted_blocks))


def _counted(cache: PrefixCache, queries: int, hits: int, evictions: int) -> PrefixCache:
    cache.num_query_tokens, cache.num_hit_tokens, cache.num_evicted = queries, hits, evictions
    return cache


def test_a_new_index_reports_its_own_counts_even_at_a_freed_indexs_address():
    """A reconnect replaces the index; CPython hands a freed object's address to the next object of its size, so
    an index keyed by id() may meet the counts of the one it replaced and report negative increments (which a
    Prometheus counter refuses, raising in the step loop)."""
    hooks = Reported()
    loop = BatchingLoop(RouterConfig(), None, hooks=hooks)
    loop.scheduler = Scheduler(LIMITS, _counted(PrefixCache(4, b"m"), 40, 12, 3))
    loop._report_prefix_cache()
    assert hooks.calls == [(40, 12, 3)]
    loop.scheduler.clear()  # the worker was lost: a new index, the old one freed
    # the reconnect's index, made while the cleared scheduler still holds its own: CPython mostly gives it the freed
    # index's address (where an id()-keyed report went wrong), not always (another allocation may take it first);
    # the counts must be its own either way
    cache = PrefixCache(4, b"m")
    loop.scheduler = Scheduler(LIMITS, _counted(cache, 8, 4, 0))  # the reconnected worker's index
    loop._report_prefix_cache()
    assert hooks.calls == [(40, 12, 3), (8, 4, 0)]
    loop._report_prefix_cache()  # nothing new: nothing reported
    assert hooks.calls == [(40, 12, 3), (8, 4, 0)]
