"""The prefix cache's hit counter (colibri_prefix_cache_hits_total) counts the prompt tokens a sequence actually
started on: those of a first chunk the worker ran. A sequence refused on its cached blocks (UNKNOWN_PREFIX_BLOCK:
the worker lacks one), or whose step was refused as a whole, reused nothing; it still counts as a query."""

import random

from router_service.scheduler import FinishReason, RequestOutput, ScheduledRequest
from tests.router_service.test_prefix_cache import BLOCK, WorkerModel, _blocks_lost_by_the_worker, make, refuse

PROMPT = list(range(1, 15))  # three full blocks and two tokens


def _cached_prompt():
    """PROMPT's blocks cached by request 1, which finished (the next step carries its free)."""
    s, worker, rng = make(), WorkerModel(32), random.Random(0)
    s.add(ScheduledRequest(1, PROMPT, 2))
    step = s.schedule()
    s.update(step, worker.run(step, rng))
    s.finish(1, FinishReason.LENGTH)
    s.prefix_cache.unreported_counts()  # request 1's own lookup: no hit
    return s, worker, rng


def test_a_hit_counts_once_the_worker_ran_the_chunk_on_it():
    s, worker, rng = _cached_prompt()
    s.add(ScheduledRequest(2, PROMPT, 2))
    step = s.schedule()
    assert step.prefill_chunks[0].prefix_block_ids == (1, 2, 3)
    assert s.prefix_cache.unreported_counts() == (len(PROMPT), 0, 0)  # looked up; not reused yet
    s.update(step, worker.run(step, rng))
    assert s.prefix_cache.unreported_counts() == (0, 3 * BLOCK, 0)


def test_a_sequence_refused_on_blocks_the_worker_lacks_counts_no_hit():
    s, _, _, prompt = _blocks_lost_by_the_worker()
    s.prefix_cache.unreported_counts()
    s.add(ScheduledRequest(2, prompt, 2))
    step = s.schedule()
    assert step.prefill_chunks[0].prefix_block_ids == (1, 2, 3)
    s.update(step, [RequestOutput(2, None, error="UNKNOWN_PREFIX_BLOCK")])
    assert s.prefix_cache.unreported_counts() == (len(prompt), 0, 0)
    assert s.prefix_cache.num_hit_tokens == 0


def test_a_sequence_whose_step_was_refused_counts_no_hit():
    s, worker, _ = _cached_prompt()
    s.add(ScheduledRequest(2, PROMPT, 2))
    step = s.schedule()
    assert step.prefill_chunks[0].prefix_block_ids == (1, 2, 3)
    refuse(s, worker, step)
    assert s.prefix_cache.unreported_counts() == (len(PROMPT), 0, 0)
