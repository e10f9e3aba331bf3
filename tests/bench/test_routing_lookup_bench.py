"""bench/routing_lookup.py end to end on a small table: every step kind timed and its message measured."""

from __future__ import annotations

import json

from bench import routing_lookup


def test_routing_lookup_times_every_step_on_a_small_table(tmp_path):
    out = tmp_path / "routing_lookup.json"
    argv = ["--layers", "2", "--vocab", "300", "--experts", "8", "--top-k", "2", "--repeats", "2", "--out", str(out)]
    assert routing_lookup.main(argv) == 0
    steps = json.loads(out.read_text())["steps"]
    assert list(steps) == ["decode_1", "decode_16", "decode_64", "prefill_512", "prefill_2048"]
    assert all(s["message_bytes"] > 0 and s["median_us"] > 0 for s in steps.values())
    assert steps["prefill_2048"]["message_bytes"] > steps["decode_1"]["message_bytes"]
