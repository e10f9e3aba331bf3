"""bench/prefix_tokens_wire.py: the cached prefix's tokens are in the admitting step's bytes only with a repetition
penalty (or for an older worker), exactly once per sequence, and in no decode step."""

import random

from bench import prefix_tokens_wire


def test_prefix_tokens_are_counted_once_and_only_where_the_worker_needs_them():
    rng = random.Random()
    sequences, prefix, tail = rng.randrange(2, 6), rng.randrange(2, 5) * 16, rng.randrange(1, 8)
    runs = {
        mode: prefix_tokens_wire.measure(mode, sequences, prefix, tail, decodes=3)
        for mode in ("repetition", "presence-frequency", "presence-frequency, older worker")
    }
    assert runs["presence-frequency"]["admitting_step_prefix_token_bytes"] == 0
    for mode in ("repetition", "presence-frequency, older worker"):
        # at least a byte per token (ids take 1 to 3 varint bytes), in one chunk per sequence
        assert runs[mode]["admitting_step_prefix_token_bytes"] >= sequences * prefix
    for run in runs.values():
        assert run["decode_steps_prefix_token_bytes"] == 0 and run["decode_step_bytes_mean"] > 0
