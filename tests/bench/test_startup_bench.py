"""bench/startup.py on the cpu backend: every start reaches readiness and lands in the JSON with its ratios."""

import json

import pytest

from bench import startup


def test_startup_bench_writes_every_start(tmp_path, capsys):
    with pytest.raises(SystemExit):
        startup.main(["--states", "warm,cold"])  # warm needs a cold start before it
    assert startup.main(["--backend", "cpu", "--out", str(tmp_path), "--name", "s", "--states", "none,cold,warm"]) == 0
    tiny = json.loads((tmp_path / "s.json").read_text())["models"]["tiny"]
    assert list(tiny["runs"]) == ["none", "cold", "warm"]
    assert all(0 < run["ready_s"] < 120 for run in tiny["runs"].values())
    assert set(tiny["ratios"]) == {"ready_none_x_none", "ready_cold_x_none", "ready_warm_x_none"}
    assert "warm" in capsys.readouterr().out
