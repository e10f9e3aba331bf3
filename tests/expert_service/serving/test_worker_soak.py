"""A bounded soak of `colibri worker` as a process: a few hundred steps over streams that end normally, are
cancelled, or vanish with their channel; the process's RSS, threads and open fds stay flat, every KV block
comes back, and nothing alarming is logged."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import pytest

from common.pb import worker_pb2 as pb
from tests.expert_service.serving.worker_process import start_worker, stub, wait_for, worker_env

pytestmark = pytest.mark.slow
GREEDY = pb.SamplingParams(top_p=1.0)
ROUNDS, WARM_ROUNDS = 36, 6  # 10 steps a round
MAX_RSS_GROWTH_KB = 16 * 1024


def footprint(pid: int) -> tuple[int, int, int]:
    """(RSS kB, threads, open fds) of a process."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]), int(fields["Threads"]), len(os.listdir(f"/proc/{pid}/fd"))


def one_round(target: str, token: str, n: int, rng: random.Random) -> int:
    """One stream: 4 sequences prefilled, up to 8 decode steps (two freed half-way), then the stream ends
    normally, is cancelled, or loses its channel. Returns the steps answered."""
    worker, channel = stub(target, token)
    ids = [n * 10 + i for i in range(4)]
    packed = lambda rids: np.asarray(rids, "<u8").tobytes()  # noqa: E731
    steps = [
        pb.StepStreamRequest(
            step_id=1,
            chunks=[
                pb.PrefillChunk(
                    request_id=r, token_ids=[3 + (r * 7 + j) % 250 for j in range(8)], sampling=GREEDY, is_last=True
                )
                for r in ids
            ],
        )
    ]
    steps += [
        pb.StepStreamRequest(
            step_id=s,
            decode_request_ids=packed(ids if s < 6 else ids[2:]),
            free_request_ids=packed(ids[:2] if s == 6 else []),
        )
        for s in range(2, 10)
    ]
    steps.append(pb.StepStreamRequest(step_id=10, free_request_ids=packed(ids[2:])))
    ending = rng.choice(["normal", "normal", "cancel", "close"])
    call, answered = worker.StepStream(iter(steps), timeout=60), 0
    for response in call:
        assert not response.step_error and not response.errors, response
        answered += 1
        if ending != "normal" and answered == rng.randint(1, 9):
            call.cancel() if ending == "cancel" else channel.close()
            break
    channel.close()
    return answered


def test_soak_keeps_rss_threads_fds_flat(tiny_model, tmp_path):
    sock = tmp_path / "w.sock"
    target, token = f"unix:{sock}", "soak-token"
    process = start_worker(tiny_model, "--socket", str(sock), env=worker_env(COLIBRI_WORKER_TOKEN=token))
    rng = random.Random(11)
    try:
        wait_for(target, "colibri.readiness", process=process)
        steps = sum(one_round(target, token, n, rng) for n in range(WARM_ROUNDS))
        before = footprint(process.pid)
        steps += sum(one_round(target, token, n, rng) for n in range(WARM_ROUNDS, ROUNDS))
        worker, channel = stub(target, token)
        # Every stream has ended: a frees-only step on a fresh stream sees the whole pool free again.
        for _ in range(100):
            last = list(worker.StepStream(iter([pb.StepStreamRequest(step_id=1)]), timeout=10))[0]
            if last.kv_blocks_used == 0:
                break
        assert last.kv_blocks_used == 0
        after = footprint(process.pid)
        channel.close()
        assert steps >= 200, steps
        assert after[0] - before[0] <= MAX_RSS_GROWTH_KB, f"RSS {before[0]} -> {after[0]} kB"
        assert after[1] == before[1], f"threads {before[1]} -> {after[1]}"
        assert after[2] <= before[2] + 2, f"fds {before[2]} -> {after[2]}"
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
        log = process.stderr.read()
    assert code == 0, log[-2000:]
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
