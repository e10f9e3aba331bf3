"""bench/serve.py --workload prefix end to end on the tiny model with the cpu backend (tiny sizes): the worker,
a router with prefix caching on and off, every workload; the JSON has every ratio, finite and positive, and the
shared workload's prompts were served from the cache with it on only. No timing assertions."""

from __future__ import annotations

import json
import math

import pytest

from bench import serve

pytestmark = pytest.mark.slow


def test_serve_prefix_bench_tiny_cpu(tmp_path):
    args = ["--workload", "prefix", "--backend", "cpu", "--clients", "3", "--rounds", "1", "--system-tokens", "32"]
    args += ["--user-tokens", "4", "--new-tokens", "2", "--out", str(tmp_path), "--name", "prefix"]
    assert serve.main(args) == 0
    entry = json.loads((tmp_path / "prefix.json").read_text())["models"]["tiny"]
    assert set(entry["ratios"]) == {
        f"{w}_{m}_on_x_off" for w in ("shared", "unshared", "multiturn") for m in ("ttft_p50", "throughput")
    }
    assert all(math.isfinite(v) and v > 0 for v in entry["ratios"].values())
    assert entry["on"]["shared"]["cached_prompt_share"] > 0.5 and entry["off"]["shared"]["cached_prompt_share"] == 0
    assert entry["on"]["unshared"]["cached_prompt_share"] == 0
    assert len(entry["on"]["shared"]["rounds"]) == 2  # one measured round in each of the two passes
    assert entry["on"]["shared"]["prefill_steps"] >= 2 and entry["off"]["unshared"]["prefill_steps"] >= 1
    with pytest.raises(SystemExit, match="only 'prefix'"):
        serve.main(["--workload", "other"])
