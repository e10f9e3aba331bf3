"""bench/plotting.py: the prefix benchmark's figure from a result, and the re-render entry point's refusals."""

from __future__ import annotations

import json
import random

import pytest

from bench import plotting


def prefix_result(rng: random.Random) -> dict:
    def workload() -> dict:
        rounds = [{"ttft_p50_ms": rng.uniform(5, 200), "throughput_tok_s": rng.uniform(100, 4000)} for _ in range(4)]
        return {"ttft_p50_ms": rounds[0]["ttft_p50_ms"], "throughput_tok_s": rounds[1]["throughput_tok_s"]} | {
            "rounds": rounds
        }

    entry = {s: {w: workload() for w in plotting.WORKLOADS} for s in ("on", "off")}
    entry["ratios"] = {
        f"{w}_{m}_on_x_off": entry["on"][w][k] / entry["off"][w][k]
        for w in plotting.WORKLOADS
        for m, k in (("ttft_p50", "ttft_p50_ms"), ("throughput", "throughput_tok_s"))
    }
    return {
        "benchmark": "serve-prefix",
        "device": "cpu",
        "machine": "test",
        "targets": {"shared_ttft_p50_on_x_off": ["<=", 0.2]},
        "models": {"tiny": entry, "other": entry},
    }


def test_prefix_figure_is_written_from_a_stored_result(tmp_path):
    path = tmp_path / "prefix.json"
    path.write_text(json.dumps(prefix_result(random.Random())))
    assert plotting.main([str(path)]) == 0
    png = (tmp_path / "prefix.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not a readable JSON result"),
        ('{"benchmark": "engine"}', "benchmark is not one of serve-prefix"),
        ("[1, 2]", "benchmark is not one of serve-prefix"),
    ],
)
def test_a_result_it_cannot_draw_is_refused_in_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "result.json"
    path.write_text(content)
    assert plotting.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{path}: {message}") and err.count("\n") == 1
    assert not (tmp_path / "result.png").exists()


def test_no_paths_prints_the_usage(capsys):
    assert plotting.main([]) == 2
    assert "usage: python -m bench.plotting" in capsys.readouterr().err
