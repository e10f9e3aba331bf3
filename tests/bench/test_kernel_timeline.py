"""bench/kernel_timeline.py's host-side parts (recording needs a GPU and torch): kernel names and the timeline
analysis of recorded events."""

from __future__ import annotations

import pytest

from bench.kernel_timeline import GAP_US, short_name, timeline_of


def test_short_name_demangles_numba_kernels():
    mangled = (
        "_ZN6cudapy14expert_service7kernels13rope_kv_write20rope_kv_write_kernelB2v1E5ArrayIfLi3E1C7mutable7alignedE"
    )
    assert short_name(mangled) == "rope_kv_write_kernel"
    long = "sm90_xmma_gemm_bf16bf16_bf16f32" + "x" * 80
    assert short_name(long) == long[:60]


def test_timeline_names_the_critical_streams_waits():
    # stream 7 computes, stream 9 copies beside it; 7 waits 40 us for 9's copy before its third kernel
    rows = [
        ("gemv", 7, 100.0, 10.0),
        ("fetch", 9, 105.0, 60.0),
        ("plan", 7, 110.5, 5.0),  # 0.5 us after the first: launch spacing, no wait
        ("gate_up", 7, 165.0, 20.0),
        ("down", 7, 185.0 + GAP_US + 1.0, 4.0),
    ]
    timeline = timeline_of(rows, wall_us=123.0)
    assert timeline["critical_stream"] == 7
    assert timeline["span_us"] == pytest.approx(185.0 + GAP_US + 1.0 + 4.0 - 100.0)
    assert timeline["streams"] == {
        "7": {"busy_us": 39.0, "kernels": 4, "by_name": {"gate_up": [20.0, 1], "gemv": [10.0, 1], "plan": [5.0, 1],
                                                          "down": [4.0, 1]}},
        "9": {"busy_us": 60.0, "kernels": 1, "by_name": {"fetch": [60.0, 1]}},
    }  # fmt: skip
    assert list(timeline["streams"]["7"]["by_name"]) == ["gate_up", "gemv", "plan", "down"]  # largest first
    assert timeline["waits"] == [
        {"at_us": 15.5, "us": 49.5, "before": "gate_up"},
        {"at_us": 85.0, "us": GAP_US + 1.0, "before": "down"},
    ]
    assert timeline["waited_us"] == pytest.approx(49.5 + GAP_US + 1.0)
    assert timeline["kernels"][1] == ["fetch", 9, 5.0, 60.0]
    assert timeline["wall_us"] == 123.0


def test_a_streams_time_by_kernel_name_sums_repeated_launches():
    rows = [("fetch", 3, 0.0, 7.0), ("gemv", 3, 8.0, 2.5), ("fetch", 3, 11.0, 4.0), ("gemv", 3, 16.0, 2.0)]
    stream = timeline_of(rows, wall_us=0.0)["streams"]["3"]
    assert stream["by_name"] == {"fetch": [11.0, 2], "gemv": [4.5, 2]}
    assert sum(us for us, _ in stream["by_name"].values()) == pytest.approx(stream["busy_us"])


def test_the_stream_that_ends_last_is_critical_and_overlaps_are_no_waits():
    rows = [("a", 1, 0.0, 50.0), ("b", 2, 10.0, 100.0), ("c", 2, 20.0, 5.0), ("d", 2, 111.0, 1.0)]
    timeline = timeline_of(rows, wall_us=0.0)
    assert timeline["critical_stream"] == 2
    assert timeline["waits"] == []  # c ran inside b's span (two graph branches on one reported stream)


def test_no_events_is_an_empty_timeline():
    assert timeline_of([], 5.0) == {
        "wall_us": 5.0,
        "span_us": 0.0,
        "streams": {},
        "waited_us": 0.0,
        "waits": [],
        "kernels": [],
    }
