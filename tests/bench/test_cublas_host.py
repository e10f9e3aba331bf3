"""bench/cublas_host.py's timing without a GPU: host time counts the calls alone, the device time the wait too."""

from __future__ import annotations

import time

from bench import cublas_host


def test_host_time_leaves_the_wait_out():
    calls, syncs = [], []
    row = cublas_host.timed(lambda: calls.append(1), 10, lambda: (syncs.append(1), time.sleep(0.02)))
    assert len(calls) == 11 and len(syncs) == 2  # one warm-up call and sync, then the timed loop and its sync
    assert row["host_us"] < 1000 <= row["with_device_us"]  # 20 ms of waiting over 10 calls: >= 2,000 us a call


def test_the_cases_are_mixtral_expert_gemms():
    shapes = {(n, k) for _, n, k, _ in cublas_host.CASES}
    assert {(2 * 14336, 4096), (4096, 14336)} <= shapes  # gate|up and down of a mixtral-shape expert
