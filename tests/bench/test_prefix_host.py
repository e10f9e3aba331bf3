"""bench/prefix_host.py at small sizes: the scheduler and the worker's pool through every setting; what each
caches and computes, not how long it takes."""

from __future__ import annotations

import json

from bench import prefix_host


def test_each_setting_caches_and_computes_what_it_should(tmp_path):
    out = tmp_path / "host.json"
    args = ["--system-tokens", "64", "--user-tokens", "16", "--new-tokens", "40", "--clients", "4"]
    assert (
        prefix_host.main([*args, "--max-batch-tokens", "128", "--rounds", "2", "--reps", "2", "--out", str(out)]) == 0
    )
    results = json.loads(out.read_text())["results"]
    # 80 prompt tokens (5 blocks) + 40 new: the decodes fill blocks 5 and 6 (the 40th token, never fed, is in 7)
    for workload in ("shared", "unshared"):
        assert results[f"{workload}_on"]["generated_blocks_cached"] == 4 * 2
        assert results[f"{workload}_on_prompts"]["generated_blocks_cached"] == 0
        assert results[f"{workload}_off"]["generated_blocks_cached"] == 0
        assert results[f"{workload}_off"]["prompt_tokens_computed"] == 4 * 80
    # shared: the first request computes the system prompt, the others only their user turns
    assert results["shared_on"]["prompt_tokens_computed"] == 80 + 3 * 16
    assert results["shared_on_prompts"]["prompt_tokens_computed"] == 80 + 3 * 16
    assert results["unshared_on"]["prompt_tokens_computed"] == 4 * 80
    assert all(v["router_ms"] > 0 and v["worker_ms"] > 0 for v in results.values() if "router_ms" in v)
