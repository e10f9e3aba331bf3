"""`colibri` processes keep stderr to their own lines: gRPC's C core, which writes raw text there (a TLS handshake a
plaintext client failed, a port it could not bind), is held silent unless GRPC_VERBOSITY asks for it."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from tests.helpers import LoggedProcess, free_port, serve_env
from tests.router_service.certs import issue, make_ca


def router_command(port: int, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "colibri.cli", "router", "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", "0", "--worker", "127.0.0.1:1", "--worker-retry-s", "0.2", *flags,
    ]  # fmt: skip


def test_a_plaintext_client_at_a_tls_router_leaves_only_json_on_stderr(tmp_path):
    """Anyone who can reach the port could put lines of raw text between the JSON ones (a port scanner, a client
    without TLS): the C core logged each failed handshake on stderr."""
    ca = make_ca()
    server = issue(ca, "localhost", server=True)
    (tmp_path / "tls.crt").write_bytes(server.cert)
    (tmp_path / "tls.key").write_bytes(server.key)
    port = free_port()
    tls = ["--tls-cert-file", str(tmp_path / "tls.crt"), "--tls-key-file", str(tmp_path / "tls.key")]
    process = LoggedProcess(router_command(port, *tls), serve_env("GRPC_VERBOSITY", "LOG_FORMAT"))
    try:
        deadline = time.monotonic() + 60
        while "router listening on" not in process.log(10**6) and time.monotonic() < deadline:
            time.sleep(0.1)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=2)  # never: each attempt is a failed handshake
            except grpc.FutureTimeoutError:
                pass
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    stderr = process.log(10**6)
    assert code == 0, stderr[-2000:]
    assert "router listening on" in stderr
    for line in stderr.splitlines():
        assert isinstance(json.loads(line), dict), line


def test_a_taken_port_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(router_command(port), env=serve_env("GRPC_VERBOSITY"), capture_output=True, timeout=60)
    assert done.returncode == 7
    assert done.stderr.decode().splitlines() == [f"colibri router: error: router gRPC 127.0.0.1:{port} is in use"]


def test_the_router_logs_at_the_level_colibri_log_level_sets():
    """COLIBRI_LOG_LEVEL (which the worker reads too) set the worker's level alone: the router logged at INFO."""
    port = free_port()
    env = {**serve_env("LOG_LEVEL", "LOG_FORMAT"), "COLIBRI_LOG_LEVEL": "WARNING"}
    process = LoggedProcess(router_command(port), env)
    try:
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # serving: past the start-up lines
            grpc.channel_ready_future(channel).result(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    stderr = process.log(10**6)
    assert code == 0, stderr[-2000:]
    levels = [json.loads(line)["level"] for line in stderr.splitlines()]
    assert "INFO" not in levels, stderr[-2000:]


@pytest.mark.parametrize(
    "env, named",
    [
        ({"LOG_LEVEL": "chatty"}, "LOG_LEVEL"),
        (
            {"COLIBRI_LOG_LEVEL": "chatty", "LOG_LEVEL": "debug"},
            "COLIBRI_LOG_LEVEL",
        ),  # the first one wins, as in both services
        ({"COLIBRI_LOG_LEVEL": "", "LOG_LEVEL": "chatty"}, "LOG_LEVEL"),  # empty: unset, as the services read it
    ],
)
def test_serve_refuses_a_bad_log_level_before_starting_anything(tmp_path, env, named):
    """serve reads the level as both services do and names the variable it came from (it named LOG_LEVEL always)."""
    done = subprocess.run(
        [sys.executable, "-m", "colibri.cli", "serve", "--model", str(tmp_path)],
        env={**serve_env("COLIBRI_LOG_LEVEL", "LOG_LEVEL"), **env},
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == [
        f"colibri serve: error: {named}: unknown level 'chatty' (expected DEBUG, INFO, WARNING, ERROR or CRITICAL)"
    ]


def test_serve_names_a_model_path_that_is_a_file(tmp_path):
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"not a directory")
    done = subprocess.run(
        [sys.executable, "-m", "colibri.cli", "serve", "--model", str(model)],
        env=serve_env(),
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == [f"colibri serve: error: --model: {model} is not a directory"]


def test_serve_names_a_config_path_it_cannot_read_before_starting_anything(tmp_path, tiny_model):
    """Both children started, each failed on the file, and serve logged the router's exit as an ERROR."""
    done = subprocess.run(
        [sys.executable, "-m", "colibri.cli", "serve", "--model", str(tiny_model), "--config", str(tmp_path)],
        env=serve_env(),
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == [f"colibri serve: error: --config: {tmp_path} is not a file"]


def _serve_refusal(tmp_path, tiny_model, *flags: str, env: dict | None = None, config: str = "") -> list[str]:
    if config:
        (tmp_path / "colibri.yaml").write_text(config)
        flags = (*flags, "--config", str(tmp_path / "colibri.yaml"))
    done = subprocess.run(
        [sys.executable, "-m", "colibri.cli", "serve", "--model", str(tiny_model), *flags],
        env={**serve_env("COLIBRI_PORT", "PORT", "COLIBRI_METRICS_PORT", "METRICS_PORT"), **(env or {})},
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr.decode()[-2000:]
    return done.stderr.decode().splitlines()


@pytest.mark.parametrize(
    "flags, env, config, message",
    [
        (["--port", "{p}", "--worker-port", "{p}"], {}, "", "--worker-port must differ from --port (both {p})"),
        (["--metrics-port", "{p}", "--worker-metrics-port", "{p}"], {}, "",
         "--worker-metrics-port must differ from --metrics-port (both {p})"),
        (["--worker-metrics-port", "{p}"], {"COLIBRI_PORT": "{p}"}, "", "--worker-metrics-port must differ from --port (both {p})"),
        (["--worker-port", "{p}"], {}, "router:\n  http_port: {p}\n", "--worker-port must differ from --http-port (both {p})"),
        (["--worker-port", "-1"], {}, "", "--worker-port: must be in [0, 65535], got -1"),
        (["--worker-metrics-port", "70000"], {}, "", "--worker-metrics-port: must be in [0, 65535], got 70000"),
    ],
)  # fmt: skip
def test_serve_refuses_its_own_processes_on_one_port_before_starting_them(
    tmp_path, tiny_model, flags, env, config, message
):
    """Both children started and one failed to bind, 'worker gRPC 127.0.0.1:P is in use' (exit 7), as if another
    program held the port; a port out of range was refused by both children, naming --port or --metrics-port."""
    p = str(free_port())
    lines = _serve_refusal(
        tmp_path,
        tiny_model,
        *(f.format(p=p) for f in flags),
        env={k: v.format(p=p) for k, v in env.items()},
        config=config.format(p=p),
    )
    assert lines == [f"colibri serve: error: {message.format(p=p)}"]


@pytest.mark.parametrize(
    "flags, env, config, port",
    [([], {}, "", 50051), ([], {"COLIBRI_PORT": "6001"}, "", 6001), ([], {}, "router: {port: 6002}", 6002),
     (["--port", "6003"], {"COLIBRI_PORT": "6001"}, "", 6003), (["--port", "0"], {}, "", 0)],
)  # fmt: skip
def test_serve_hints_the_port_the_router_resolves(tmp_path, monkeypatch, flags, env, config, port):
    """The hint named --port or 50051: a port from the environment or the config file, or a free one (0), was
    shown as 50051."""
    from colibri import serve as serve_module
    from colibri.cli import build_parser

    for name in ("COLIBRI_PORT", "PORT", "COLIBRI_METRICS_PORT", "METRICS_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if config:
        (tmp_path / "colibri.yaml").write_text(config)
        flags = [*flags, "--config", str(tmp_path / "colibri.yaml")]
    seen = []

    def run(self) -> int:  # stands in for the children, and removes the private directory as the real run does
        seen.append(self.router_port)
        shutil.rmtree(self.private_dir)
        return 0

    monkeypatch.setattr(serve_module.Supervisor, "run", run)
    monkeypatch.setattr(sys, "argv", ["colibri", "serve"])
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), *flags])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert serve_module.run(args) == 0 and seen == [port]
    finally:  # run() ignores both once its exit status is decided
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_serve_gives_the_router_model_once_and_the_batch_limits_to_both(tmp_path, monkeypatch):
    """The router's command line held `--model DIR` twice. The batch limits go to both processes: the router caps
    its own to the worker's but never raises them, so `serve --max-batch-tokens 4096` given to the worker alone left
    the router's step budget at 2048 (docs/configuration.md: it goes to both)."""
    from colibri import serve as serve_module
    from colibri.cli import build_parser

    monkeypatch.setattr(sys, "argv", ["colibri", "serve"])
    args = build_parser().parse_args(
        ["serve", "--model", str(tmp_path), "--max-batch-tokens", "4096", "--max-batch-size", "4", "--port", "0"]
    )
    supervisor = serve_module.Supervisor(args)
    shutil.rmtree(supervisor.private_dir)
    router, worker = supervisor.router_cmd, supervisor.worker_cmd
    assert router.count("--model") == 1 and router[router.index("--model") + 1] == str(tmp_path)
    for cmd in (router, worker):
        assert cmd.count("--max-batch-tokens") == 1 and cmd[cmd.index("--max-batch-tokens") + 1] == "4096"
        assert cmd.count("--max-batch-size") == 1 and cmd[cmd.index("--max-batch-size") + 1] == "4"
    assert worker.count("--model") == 1
    assert router[router.index("--port") + 1] == "0"


LUT_WITHOUT_TABLE = (
    "colibri serve: error: --routing lut needs --routing-table: the worker then takes each token's experts from "
    "the router's table, and the router has none"
)


@pytest.mark.parametrize(
    "flags, env, config",
    [(["--routing", "lut"], {}, ""), ([], {"COLIBRI_ROUTING": "lut"}, ""), ([], {}, "engine:\n  routing: lut\n")],
)
def test_serve_refuses_lut_routing_without_a_routing_table(tmp_path, tiny_model, flags, env, config):
    """Both children started, and the router never took the lut worker (no plans without a table): serve stayed
    up, never ready."""
    assert _serve_refusal(tmp_path, tiny_model, *flags, env=env, config=config) == [LUT_WITHOUT_TABLE]


@pytest.mark.parametrize(
    "flags, env, config",
    [(["--routing-table", "t.bin"], {}, ""), ([], {"COLIBRI_ROUTING_TABLE": "t.bin"}, ""),
     ([], {}, "router:\n  routing_table: t.bin\n")],
)  # fmt: skip
def test_serve_takes_lut_routing_with_a_table_from_any_source(tmp_path, monkeypatch, flags, env, config):
    from colibri import serve as serve_module
    from colibri.cli import build_parser
    from common.config import load_config_file

    monkeypatch.delenv("COLIBRI_ROUTING_TABLE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if config:
        (tmp_path / "colibri.yaml").write_text(config)
        flags = [*flags, "--config", str(tmp_path / "colibri.yaml")]
    monkeypatch.setattr(sys, "argv", ["colibri", "serve"])
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--routing", "lut", *flags])
    sections = {name: load_config_file(args.config, name) for name in ("router", "engine")}
    serve_module._check_routing(args, serve_module._check_ports(args, sections["router"]), sections["engine"])


@pytest.mark.parametrize(
    "flags, env, config",
    [(["--worker-step-timeout-s", "120"], {}, ""), ([], {"COLIBRI_STEP_TIMEOUT_S": "330"}, ""),
     ([], {}, "worker:\n  step_timeout_s: 400\n"), ([], {"COLIBRI_WORKER_STEP_TIMEOUT": "300"}, "")],
)  # fmt: skip
def test_serve_refuses_a_router_step_timeout_the_worker_watchdog_outlasts(tmp_path, tiny_model, flags, env, config):
    """The router's 120 s step deadline ran out on steps the worker's 300 s watchdog still let run: requests failed
    DEADLINE_EXCEEDED while the worker kept the step (and queued the next ones behind it)."""
    lines = _serve_refusal(tmp_path, tiny_model, *flags, env=env, config=config)
    assert len(lines) == 1 and lines[0].startswith("colibri serve: error: router worker_step_timeout_s="), lines
    assert "must exceed the worker's watchdog step_timeout_s" in lines[0]


def test_serve_compares_the_step_timeouts_from_every_source(tmp_path, monkeypatch):
    import random

    from colibri import serve as serve_module
    from colibri.cli import build_parser
    from common.config import load_config_file
    from common.errors import ConfigError

    for name in ("COLIBRI_STEP_TIMEOUT_S", "COLIBRI_WORKER_STEP_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    watchdog = random.uniform(1, 1000)
    (tmp_path / "colibri.yaml").write_text(f"worker:\n  step_timeout_s: {watchdog!r}\n")
    monkeypatch.setattr(sys, "argv", ["colibri", "serve"])
    for router_s, refused in ((watchdog + random.uniform(0.5, 100), False), (watchdog, True)):
        argv = ["serve", "--model", str(tmp_path), "--config", str(tmp_path / "colibri.yaml")]
        args = build_parser().parse_args([*argv, "--worker-step-timeout-s", repr(router_s)])
        sections = {name: load_config_file(args.config, name) for name in ("router", "worker")}
        router = serve_module._check_ports(args, sections["router"])
        if refused:
            with pytest.raises(ConfigError, match="must exceed the worker's watchdog"):
                serve_module._check_step_timeouts(args, router, sections["worker"])
        else:
            serve_module._check_step_timeouts(args, router, sections["worker"])
    assert (
        serve_module._check_ports(build_parser().parse_args(["serve", "--model", "m"]), {}).worker_step_timeout_s > 300
    )
