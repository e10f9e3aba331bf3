"""bench/serve.py end to end on the tiny model with the cpu backend (tiny sizes): the engine alone, the worker
and router processes at both pipeline depths, streaming clients (in this process for 1 client, in two
spawned processes for 2); the JSON has every field and its ratios are finite and positive. No timing
assertions: the numbers depend on the machine."""

from __future__ import annotations

import json
import math

import pytest

from bench import serve, serve_clients

pytestmark = pytest.mark.slow

CLIENTS, PROMPT, NEW, ROUNDS = (1, 2), 8, 4, 1


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_serve_bench_tiny_cpu(tmp_path):
    assert (
        serve.main(
            [
                "--backend",
                "cpu",
                "--clients",
                ",".join(map(str, CLIENTS)),
                "--prompt-tokens",
                str(PROMPT),
                "--new-tokens",
                str(NEW),
                "--rounds",
                str(ROUNDS),
                "--client-procs",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    results = json.loads((tmp_path / "cpu-serve-tiny.json").read_text())
    assert (tmp_path / "cpu-serve-tiny.png").read_bytes()[:4] == b"\x89PNG"  # matplotlib: the test extra

    assert results["benchmark"] == "serve" and results["machine"] and results["device"].startswith("cpu")
    config = results["config"]
    assert config["backend"] == "cpu" and config["clients"] == list(CLIENTS) and config["pipeline_depths"] == [3, 2, 1]
    assert (config["prompt_tokens"], config["new_tokens"], config["rounds"]) == (PROMPT, NEW, ROUNDS)
    assert config["max_batch_size"] >= 64 and config["max_concurrent_requests"] >= 64
    assert config["kv_cache_tokens"] >= max(CLIENTS) * (PROMPT + NEW)

    entry = results["models"]["tiny"]
    assert entry["model"]["family"] == "mixtral"
    engine = entry["engine"]
    assert finite_positive(engine["prefill_ms"])
    for n in CLIENTS:
        b = engine["batches"][str(n)]
        assert b["decode_steps"] == ROUNDS * (NEW - 1) and b["prefill_steps"] >= 1
        for value in (b["decode_step_ms"]["p50"], b["tok_s"], b["prefill_all_ms"], b["generation_tok_s"]):
            assert finite_positive(value)

    assert list(entry["served"]) == ["3", "2", "1"]
    for depth, by_n in entry["served"].items():
        assert list(by_n) == [str(n) for n in CLIENTS]
        for n, s in by_n.items():
            n = int(n)
            rounds = max(ROUNDS, -(-serve_clients.MIN_REQUESTS // n))  # small N: more rounds, for TTFT
            assert s["clients"] == n and s["rounds"] == rounds and s["requests"] == n * rounds
            assert s["client_processes"] == min(n, 2)  # 2 clients: two spawned client processes
            assert s["errors"] == 0 and s["incomplete_requests"] == 0, s["error_samples"]
            assert s["tokens"] == n * rounds * NEW and s["itl_ms"]["gaps"] == n * rounds * (NEW - 1)
            assert s["tokens_per_message"] == 1.0
            assert s["throughput_window"] in ("steady", "whole")
            for value in (
                s["ttft_ms"]["p50"],
                s["itl_ms"]["p50"],
                s["itl_ms"]["mean"],
                s["throughput_tok_s"],
                s["whole_round_tok_s"],
            ):
                assert finite_positive(value)
            assert s["stalls"]["count"] >= 0 and s["router"]["steps"] > 0
            assert finite_positive(s["router"]["mean_batch_size"])

        ratios = entry["ratios"][depth]
        assert set(ratios["headline"]) == {
            "itl_p50_1client_x_engine_b1_step",
            "ttft_p50_1client_minus_engine_prefill_ms",
        }
        assert finite_positive(ratios["headline"]["itl_p50_1client_x_engine_b1_step"])
        assert math.isfinite(ratios["headline"]["ttft_p50_1client_minus_engine_prefill_ms"])
        for n in CLIENTS:
            row = ratios["by_clients"][str(n)]
            for key in ("itl_p50_x_engine_step", "throughput_x_engine", "ttft_p50_x_engine_prefill"):
                assert finite_positive(row[key]), (depth, n, key, row[key])
            assert math.isfinite(row["ttft_p50_minus_engine_prefill_ms"])
    for n in CLIENTS:
        assert all(finite_positive(v) for v in entry["ratios"]["pipelining"][str(n)].values())
