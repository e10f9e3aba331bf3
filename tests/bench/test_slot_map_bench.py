"""bench/slot_map.py in the simulator: its copy of the previous one-thread kernels and the current block kernels
make the same decisions on every case it times (what its `same_state` column checks on the GPU), and both match
the numpy reference."""

import json

import numpy as np
import pytest

from bench import slot_map as bench
from expert_service.experts.slot_map_reference import SlotMapState, plan_demand, plan_prefetch, waves_needed


@pytest.mark.parametrize("name", list(bench.CASES))
def test_previous_and_current_kernels_decide_alike_on_the_bench_cases(name):
    E, S, T, K, kind = bench.CASES[name]
    W = waves_needed(T * K, E, S)
    seq = bench.steps(np.random.default_rng(1), E, T, K, kind)
    ref = SlotMapState.empty(E, S)
    finals = []
    for previous in (True, False):
        state = bench.layer(E, S, W)
        launch = bench.launcher(state, seq, kind, previous)
        for i in range(4):
            launch(i, 0)
        finals.append({k: state[k].copy_to_host() for k in bench.STATE})
    for tick in range(1, 5):
        ids = [a.copy_to_host() for a in seq[tick - 1]]
        if kind == "prefetch":
            plan_prefetch(ref, *ids, tick)
        else:
            plan_demand(ref, ids[0], tick, W)
    for k in bench.STATE:
        np.testing.assert_array_equal(finals[0][k], getattr(ref, k), err_msg=k)
        np.testing.assert_array_equal(finals[1][k], getattr(ref, k), err_msg=k)
    assert ref.stats.sum() > 0


def test_main_times_both_kernels_and_writes_their_decisions(tmp_path, monkeypatch):
    """main on two cases with the launches timed in a plain loop (the simulator captures no CUDA graph)."""
    timed = []

    def loop_timed(launch, stream, repeats):
        for i in range(repeats):
            launch(i, stream)
        timed.append(repeats)
        return 1e-6

    monkeypatch.setattr(bench, "graph_timed", loop_timed)
    out = tmp_path / "slot_map.json"
    assert bench.main(["--out", str(out), "--repeats", "2", "--cases", "mixtral_decode,prefetch"]) == 0
    result = json.loads(out.read_text())
    assert list(result["cases"]) == ["mixtral_decode", "prefetch"] and timed == [2] * 5  # the tick, 2 x 2 cases
    for row in result["cases"].values():
        assert row["same_state"] is True and row["ratio"] == 1.0 and sum(row["stats"]) > 0
