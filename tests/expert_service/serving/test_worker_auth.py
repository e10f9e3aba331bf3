"""Who may call the worker: the bearer token (file or environment, rotation), the owner-only Unix socket, and
the refusal to serve a reachable address without either."""

from __future__ import annotations

import dataclasses
import os
import socket
import stat
import subprocess
import sys

import grpc
import pytest

from common.auth import TokenSet
from common.errors import ConfigError
from common.pb import worker_pb2 as pb
from tests.expert_service.serving.worker_process import free_port, start_worker, stub, wait_for, worker_env
from tests.helpers import BackgroundWorker, LoggedProcess

GREEDY = pb.SamplingParams(top_p=1.0)


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("# the router <-> worker token\nfirst-token\n\nsecond-token\n")
    return path


def test_token_file_rotation_and_env(token_file, monkeypatch):
    tokens = TokenSet(str(token_file), token=" env-token ")
    assert tokens.accepts(b"Bearer first-token") and tokens.accepts(b"Bearer second-token")
    assert tokens.accepts(b"Bearer env-token")
    assert not tokens.accepts(b"Bearer ") and not tokens.accepts(b"Bearer first")
    assert not tokens.accepts(b"Bearer # the router") and not tokens.accepts(b"first-token")
    monkeypatch.setattr("common.auth.RECHECK_S", 0.0)
    token_file.write_text("third-token\n")
    assert tokens.accepts(b"Bearer third-token") and not tokens.accepts(b"Bearer first-token")
    token_file.write_text("")  # mid-rotation: an empty file keeps what was accepted
    assert tokens.accepts(b"Bearer third-token")
    assert not TokenSet() and not TokenSet("", "  ")


@pytest.mark.parametrize("content", [None, "", "# only a comment\n"])
def test_unusable_token_file_is_a_config_error(tmp_path, content):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match="auth_token_file"):
        TokenSet(str(path))


def test_calls_need_the_token_health_and_reflection_do_not(tiny_model, token_file):
    worker = BackgroundWorker(tiny_model)
    worker.config = dataclasses.replace(worker.config, auth_token_file=str(token_file))
    worker.start()
    try:
        anonymous, channel = stub(worker.address)
        wrong, wrong_channel = stub(worker.address, "not-the-token")
        for call in (
            lambda s: s.Info(pb.InfoRequest(), timeout=10),
            lambda s: s.ClearCache(pb.ClearCacheRequest(), timeout=10),
            lambda s: list(s.StepStream(iter([pb.StepStreamRequest(step_id=1)]), timeout=10)),
        ):
            for s in (anonymous, wrong):
                with pytest.raises(grpc.RpcError) as e:
                    call(s)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Bytes from an unauthenticated caller are never parsed: still UNAUTHENTICATED, not INVALID_ARGUMENT.
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary("/colibri.worker.v1.WorkerService/Prefill")(b"\xff\xff\xff", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        wait_for(worker.address, "colibri.readiness")  # health: no token needed
        for token in ("first-token", "second-token"):
            good, good_channel = stub(worker.address, token)
            assert good.Info(pb.InfoRequest(), timeout=10).vocab_size == 259
            steps = [
                pb.StepStreamRequest(
                    step_id=1, chunks=[pb.PrefillChunk(request_id=5, token_ids=[5, 6], sampling=GREEDY, is_last=True)]
                )
            ]
            assert len(list(good.StepStream(iter(steps), timeout=10))) == 1
            good_channel.close()
        # With the token the bytes are parsed: a malformed step ends the stream after the steps before it.
        raw = channel.stream_stream("/colibri.worker.v1.WorkerService/StepStream")
        frames = [pb.StepStreamRequest(step_id=2).SerializeToString(), b"\xff\xff\xff"]
        answers = []
        with pytest.raises(grpc.RpcError) as e:
            answers.extend(raw(iter(frames), timeout=10, metadata=(("authorization", "Bearer first-token"),)))
        assert len(answers) == 1 and e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("request: not a colibri.worker.v1.StepStreamRequest"), e.value.details()
        channel.close()
        wrong_channel.close()
    finally:
        worker.stop()


def test_unix_socket_is_owner_only_and_a_stale_file_is_replaced(tiny_model, tmp_path):
    sock = tmp_path / "worker.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))  # left behind by a killed worker: bound, nobody listening
    stale.close()
    process = start_worker(tiny_model, "--socket", str(sock))
    try:
        wait_for(f"unix:{sock}", "colibri.readiness", process=process)
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        s, channel = stub(f"unix:{sock}")
        assert s.Info(pb.InfoRequest(), timeout=10).backend == "cpu"
        channel.close()
        # A second worker on the same socket: it is live, so the second one must not take it over.
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "colibri.cli",
                "worker",
                "--model",
                str(tiny_model),
                "--backend",
                "cpu",
                "--socket",
                str(sock),
                "--metrics-port",
                "0",
            ],
            env=worker_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 7, second.stderr
        assert second.stderr.strip().splitlines()[-1] == f"colibri worker: error: worker gRPC unix:{sock} is in use"
        assert process.poll() is None
    finally:
        process.terminate()
        assert process.wait(60) == 0


def test_reachable_address_without_a_token_is_refused(tiny_model):
    port = free_port()
    base = [
        sys.executable,
        "-m",
        "colibri.cli",
        "worker",
        "--model",
        str(tiny_model),
        "--backend",
        "cpu",
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        "--metrics-port",
        "0",
    ]
    refused = subprocess.run(base, env=worker_env(), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0 and "without a token" in refused.stderr, refused.stderr
    # With a token from the environment it serves; the token never appears in its command line.
    process = LoggedProcess(base + ["--warmup-tokens", "4"], worker_env(COLIBRI_WORKER_TOKEN="env-secret"))
    try:
        wait_for(f"127.0.0.1:{port}", "colibri.readiness", process=process)
        with open(f"/proc/{process.pid}/cmdline", "rb") as f:
            assert b"env-secret" not in f.read()
        s, channel = stub(f"127.0.0.1:{port}", "env-secret")
        assert s.Health(pb.HealthRequest(), timeout=10).ready
        channel.close()
    finally:
        process.terminate()
        assert process.wait(60) == 0
