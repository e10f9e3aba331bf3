"""bench/host_timeline.py without a GPU: marks around fake host parts, in call order, originals restored."""

from __future__ import annotations

import time

import pytest

from bench import host_timeline


class Stage:
    def launch(self):
        self.work(0.002)
        return "launched"

    def work(self, seconds):
        time.sleep(seconds)


def test_marks_follow_the_calls_and_the_originals_come_back():
    stage = Stage()
    original_launch, original_work = Stage.launch, Stage.work
    synced = []
    marks = host_timeline.host_timeline(
        lambda: stage.launch(), lambda: synced.append(1), repeats=2, parts=[(Stage, "launch"), (Stage, "work")]
    )
    assert synced == [1, 1]
    labels = [label for label, _ in marks]
    assert labels == ["Stage.launch >", "Stage.work >", "Stage.work <", "Stage.launch <", "end"]
    times = [us for _, us in marks]
    assert times == sorted(times) and times[2] - times[1] >= 1900  # the 2 ms inside work, in microseconds
    assert Stage.launch is original_launch and Stage.work is original_work
    assert stage.launch() == "launched"  # a wrapped method kept its return value; unwrapped now


def test_originals_come_back_when_the_step_raises():
    original = Stage.work

    def failing():
        Stage().work(0)
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        host_timeline.host_timeline(failing, lambda: None, parts=[(Stage, "work")])
    assert Stage.work is original


def test_the_cuda_parts_exist():
    """Every marked part is a method of the class named (a rename would silently drop its marks)."""
    for owner, name in host_timeline._parts():
        assert callable(getattr(owner, name)), (owner, name)


def test_profile_step_prints_the_timeline(capsys):
    from bench import profile_step

    entry = {"wall_us": 100.0, "device_busy_us": 50.0, "kernels": {}, "host_timeline": [("Graph.replay >", 3.0)]}
    profile_step._print("shape", "fused", "prefill_1x512", entry, 4)
    out = capsys.readouterr().out
    assert "host timeline of one step" in out and "Graph.replay >" in out
