"""bench/wire_host.py: every stage of a decode step's trip is timed at every batch size, and each side's total is
the sum of its stages."""

from bench import wire_host


def test_every_stage_is_timed_and_the_totals_add_up():
    results = wire_host.measure(steps=5, warmup=2)
    assert set(results) == {f"b{b}" for b in wire_host.BATCHES}
    stages = {"router.schedule", "router.encode", "router.update", "router.decode", "worker.decode", "worker.step",
              "worker.encode"}  # fmt: skip
    for timings in results.values():
        assert stages < set(timings) and all(timings[s] > 0 for s in stages)
        for side in ("router", "worker"):
            parts = sum(v for k, v in timings.items() if k.startswith(side + ".") and k != f"{side}.total")
            assert abs(timings[f"{side}.total"] - parts) < 1e-6
