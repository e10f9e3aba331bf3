"""bench/serve_hops.py: the transition summary on synthetic stamps, and one tiny cpu serving run whose stamps come
from both processes (the worker's answer reaches the router's apply; the worker launches more than once)."""

from __future__ import annotations

import json

import pytest

from bench import serve_hops


def test_summarize_medians_and_launch_period():
    events = []
    for step in range(5):
        t = step * 1_000_000  # one step a millisecond (stamps are nanoseconds)
        events += [(t, "W_launch>"), (t + 200_000, "W_answer<"), (t + 500_000 + step * 1000, "R_apply>")]
    summary = serve_hops.summarize(events, min_count=3)
    rows = summary["transitions"]
    assert rows["W_launch> -> W_answer<"] == {"count": 5, "p50_us": 200.0, "mean_us": 200.0}
    assert rows["W_answer< -> R_apply>"]["p50_us"] == pytest.approx(302.0)
    assert rows["R_apply> -> W_launch>"]["count"] == 4
    assert summary["worker_launch_period"] == {"count": 4, "p50_us": 1000.0}
    assert "R_apply> -> W_launch>" not in serve_hops.summarize(events, min_count=5)["transitions"]


def test_summarize_without_launches():
    assert serve_hops.summarize([(0, "R_send>"), (5, "R_write<")], 1)["worker_launch_period"] is None


@pytest.mark.slow
def test_serve_hops_tiny_cpu(tmp_path):
    out = tmp_path / "hops.json"
    bench_args = ["--backend", "cpu", "--clients", "1", "--depths", "1", "--prompt-tokens", "8", "--new-tokens", "4"]
    timeline = tmp_path / "timeline.json"
    ours = ["--out", str(out), "--min-count", "3", "--timeline", str(timeline)]
    assert serve_hops.main([*ours, "--", *bench_args, "--rounds", "1"]) == 0
    result = json.loads(out.read_text())
    assert result["command"][:2] == ["--backend", "cpu"]
    assert "W_answer< -> R_apply>" in result["transitions"]
    assert all(row["p50_us"] > 0 and row["count"] >= 3 for row in result["transitions"].values())
    assert result["worker_launch_period"]["count"] >= 3
    launches = [label.split()[1] for _, name, label in json.loads(timeline.read_text()) if name == "W_launch>"]
    assert "p8d0" in launches and "p0d1" in launches  # the 8-token prompts' prefills, one-sequence decodes
