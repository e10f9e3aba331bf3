"""bench/fetch_yield.py in the CUDA simulator (timings mean nothing there): every run copies its blocks whole, the
demand count ends at 0, and the JSON holds each mode's times and the ratios."""

from __future__ import annotations

import json

from bench import fetch_yield


def test_the_bench_copies_every_block_and_writes_its_ratios(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch_yield, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(fetch_yield, "REPEATS", 2)
    monkeypatch.setattr(fetch_yield, "HEAD_START_S", 0.0)
    out = tmp_path / "fetch-yield.json"
    assert fetch_yield.main(["--out", str(out)]) == 0  # measure() checks the copies and the count itself
    result = json.loads(out.read_text())
    for key in ("alone_demand_ms", "shared_demand_ms", "yield_demand_ms", "shared_prefetch_ms", "yield_prefetch_ms"):
        assert key in result
    assert result["demand_yield_x_alone"] == result["yield_demand_ms"] / result["alone_demand_ms"]
