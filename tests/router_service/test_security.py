"""What the public port trusts: TLS and mutual TLS with certificates rotated in place, bearer tokens from a file
that changes, the plaintext health-only port, the token sent to the worker, Kubernetes service-link variables."""

import asyncio
import logging
import os
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import auth
from common.config import resolve
from common.pb import router_pb2 as rpb
from common.pb import router_pb2_grpc, worker_pb2_grpc
from router_service import generate_cmd, security
from router_service.config import RouterConfig
from router_service.main import start_router
from tests.grpc_teardown import served
from tests.helpers import free_port
from tests.router_service.certs import issue, make_ca
from tests.router_service.fake_worker import FakeWorker, harness, ids_request, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(autouse=True)
def recheck_at_once(monkeypatch):
    monkeypatch.setattr(auth, "RECHECK_S", 0.0)


def write(path, data):
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


async def model_info(port, credentials=None, metadata=None):
    """ModelInfo over a fresh channel (TLS when `credentials`): the response, or the error's status code."""
    target = f"127.0.0.1:{port}"
    channel = grpc.aio.secure_channel(target, credentials) if credentials else grpc.aio.insecure_channel(target)
    try:
        return await router_pb2_grpc.GenerationServiceStub(channel).ModelInfo(
            rpb.ModelInfoRequest(), timeout=5, metadata=metadata
        )
    except grpc.aio.AioRpcError as e:
        return e.code()
    finally:
        await channel.close()


def creds(ca=None, client=None):
    return grpc.ssl_channel_credentials(
        root_certificates=ca.cert if ca else None,
        private_key=client.key if client else None,
        certificate_chain=client.cert if client else None,
    )


def test_tls_needs_the_right_ca(tmp_path):
    ca, other_ca = make_ca(), make_ca("other CA")
    server = issue(ca, "localhost", server=True)
    files = dict(
        tls_cert_file=write(tmp_path / "tls.crt", server.cert), tls_key_file=write(tmp_path / "tls.key", server.key)
    )

    async def main():
        async with harness(**files) as (router, _, _, _):
            assert (await model_info(router.port, creds(ca))).vocab_size > 0
            assert await model_info(router.port, creds(other_ca)) == grpc.StatusCode.UNAVAILABLE
            assert await model_info(router.port, creds()) == grpc.StatusCode.UNAVAILABLE  # system CAs
            assert await model_info(router.port) == grpc.StatusCode.UNAVAILABLE  # plaintext

    asyncio.run(main())


def test_mtls_requires_a_client_certificate_from_the_ca(tmp_path):
    ca, other_ca = make_ca(), make_ca("other CA")
    server = issue(ca, "localhost", server=True)
    files = dict(
        tls_cert_file=write(tmp_path / "tls.crt", server.cert),
        tls_key_file=write(tmp_path / "tls.key", server.key),
        tls_client_ca_file=write(tmp_path / "ca.crt", ca.cert),
    )

    async def main():
        async with harness(**files) as (router, _, _, _):
            assert (await model_info(router.port, creds(ca, issue(ca, "client", server=False)))).vocab_size > 0
            assert await model_info(router.port, creds(ca)) == grpc.StatusCode.UNAVAILABLE
            stranger = issue(other_ca, "client", server=False)
            assert await model_info(router.port, creds(ca, stranger)) == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def k8s_secret(directory, version: str, files: dict[str, bytes]) -> None:
    """Writes `files` the way the kubelet updates a mounted Secret: a new `..VERSION` directory, then an atomic
    swap of the `..data` symlink; the visible names link through `..data`."""
    target = directory / f"..{version}"
    target.mkdir()
    for name, data in files.items():
        (target / name).write_bytes(data)
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")
    (directory / "..data_tmp").symlink_to(target.name)
    os.replace(directory / "..data_tmp", directory / "..data")


def test_certificate_rotation_without_restart(tmp_path):
    old_ca, new_ca = make_ca("old CA"), make_ca("new CA")
    old, new = issue(old_ca, "localhost", server=True), issue(new_ca, "localhost", server=True)
    k8s_secret(tmp_path, "v1", {"tls.crt": old.cert, "tls.key": old.key})

    async def main():
        async with harness(tls_cert_file=str(tmp_path / "tls.crt"), tls_key_file=str(tmp_path / "tls.key")) as (
            router,
            _,
            _,
            _,
        ):
            assert (await model_info(router.port, creds(old_ca))).vocab_size > 0
            # Half a rotation (a new certificate with the old key) is not served: the old pair stays.
            k8s_secret(tmp_path, "v2", {"tls.crt": new.cert, "tls.key": old.key})
            assert (await model_info(router.port, creds(old_ca))).vocab_size > 0
            k8s_secret(tmp_path, "v3", {"tls.crt": new.cert, "tls.key": new.key})
            assert (await model_info(router.port, creds(new_ca))).vocab_size > 0
            assert await model_info(router.port, creds(old_ca)) == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_token_file_several_tokens_reloaded(tmp_path):
    tokens = tmp_path / "tokens"
    write(tokens, "# API tokens\nalpha\n\n  beta  \n")
    bearer = lambda token: (("authorization", f"Bearer {token}"),)  # noqa: E731

    async def main():
        async with harness(auth_token_file=str(tokens)) as (router, _, _, channel):
            for token in ("alpha", "beta"):
                assert (await model_info(router.port, metadata=bearer(token))).vocab_size > 0
            for metadata in (bearer("gamma"), bearer("alph"), (("authorization", "alpha"),), None):
                assert await model_info(router.port, metadata=metadata) == grpc.StatusCode.UNAUTHENTICATED
            # Undecodable bytes: an unauthenticated caller learns nothing; an authenticated one INVALID_ARGUMENT.
            raw = channel.unary_unary("/colibri.router.v1.GenerationService/Generate")
            for metadata, code in (
                (None, grpc.StatusCode.UNAUTHENTICATED),
                (bearer("beta"), grpc.StatusCode.INVALID_ARGUMENT),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await raw(b"\xff\xff\xff", metadata=metadata)
                assert err.value.code() == code
            health = health_pb2_grpc.HealthStub(channel)
            assert (await health.Check(health_pb2.HealthCheckRequest(service="colibri.readiness"))).status == SERVING
            write(tokens, "gamma\n")  # rotated: the new token works at once, the old ones no longer
            assert (await model_info(router.port, metadata=bearer("gamma"))).vocab_size > 0
            assert await model_info(router.port, metadata=bearer("alpha")) == grpc.StatusCode.UNAUTHENTICATED
            write(tokens, "")  # an emptied file keeps the previous tokens (a half-written file locks nobody out)
            assert (await model_info(router.port, metadata=bearer("gamma"))).vocab_size > 0

    asyncio.run(main())


def test_token_file_over_64_kib_is_refused_at_start(tmp_path):
    """A token file is read up to 64 KiB (a wrong path, say a model file, is not read whole into memory)."""
    from common.errors import ConfigError

    config = RouterConfig(auth_token_file=write(tmp_path / "tokens", "t" * (64 * 1024 + 1)))
    with pytest.raises(ConfigError, match=r"^auth_token_file: .*tokens is larger than 65536 bytes$"):
        security.public_tokens(config)


def test_plaintext_health_port_beside_tls(tmp_path):
    ca = make_ca()
    server = issue(ca, "localhost", server=True)
    files = dict(
        tls_cert_file=write(tmp_path / "tls.crt", server.cert), tls_key_file=write(tmp_path / "tls.key", server.key)
    )
    fake = FakeWorker()
    fake.ready = False

    async def main():
        async with harness(fake, wait_ready=False, health_port=free_port(), **files) as (router, _, _, _):
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.health_port}")
            health = health_pb2_grpc.HealthStub(channel)
            check = lambda name: health.Check(health_pb2.HealthCheckRequest(service=name))  # noqa: E731
            assert (await check("colibri.liveness")).status == SERVING
            for name in ("", "colibri.readiness", "colibri.router.v1.GenerationService"):
                assert (await check(name)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            fake.ready = True
            await wait_for(lambda: router.batching_loop.is_worker_ready)
            await asyncio.sleep(0.05)
            assert (await check("colibri.readiness")).status == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:  # the health port serves nothing else
                await router_pb2_grpc.GenerationServiceStub(channel).ModelInfo(rpb.ModelInfoRequest())
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            await channel.close()

    asyncio.run(main())


def test_worker_token_sent_on_every_worker_call(tmp_path, monkeypatch):
    seen = []

    class RequireToken(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            seen.append((details.method.rsplit("/", 1)[-1], dict(details.invocation_metadata).get("authorization")))
            return await continuation(details)

    async def main():
        fake = FakeWorker()
        server = grpc.aio.server(interceptors=[RequireToken()])
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(fake, server)
        async with served(server) as port:
            config = RouterConfig(
                host="127.0.0.1",
                port=0,
                metrics_port=0,
                worker_retry_s=0.05,
                worker_token_file=write(tmp_path / "token", "s3cret\n"),
            )
            router = await start_router(config, f"127.0.0.1:{port}")
            try:
                await wait_for(lambda: router.batching_loop.is_worker_ready)
                channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
                assert (
                    await router_pb2_grpc.GenerationServiceStub(channel).Generate(ids_request([5], max_new_tokens=2))
                ).generated_tokens == 2
                await channel.close()
            finally:
                await router.stop(0.1)
        assert {m for m, _ in seen} >= {"Info", "Health", "ClearCache", "StepStream"}
        assert {token for _, token in seen} == {"Bearer s3cret"}

    asyncio.run(main())

    monkeypatch.setenv("COLIBRI_WORKER_TOKEN", "from-env")
    config = resolve(RouterConfig, env=os.environ)
    assert security.worker_token_source(config)() == "from-env" and "from-env" not in repr(config)


def test_service_link_variables_are_ignored_with_a_warning(caplog):
    env = {
        "COLIBRI_PORT": "tcp://10.0.0.1:50051",
        "COLIBRI_SERVICE_HOST": "10.0.0.1",
        "COLIBRI_SERVICE_PORT": "50051",
        "COLIBRI_PORT_50051_TCP": "tcp://10.0.0.1:50051",
        "COLIBRI_PORT_50051_TCP_PORT": "50051",
        "COLIBRI_METRICS_PORT": "udp://10.0.0.2:9090",
        "COLIBRI_MAX_BATCH_SIZE": "8",
    }
    with caplog.at_level(logging.WARNING, "colibri.config"):
        config = resolve(RouterConfig, env=env)
    assert config.port == 50051 and config.metrics_port == 9090 and config.max_batch_size == 8
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "COLIBRI_PORT=" in warned and "service link" in warned and "COLIBRI_METRICS_PORT" in warned
    assert resolve(RouterConfig, env={"COLIBRI_PORT": "tcp://10.0.0.1:50051", "PORT": "7"}).port == 7


def test_colibri_generate_over_mtls_with_a_token_file(tmp_path, capsys):
    ca = make_ca()
    server, client = issue(ca, "localhost", server=True), issue(ca, "client", server=False)
    files = dict(
        tls_cert_file=write(tmp_path / "tls.crt", server.cert),
        tls_key_file=write(tmp_path / "tls.key", server.key),
        tls_client_ca_file=write(tmp_path / "ca.crt", ca.cert),
    )
    token_file = write(tmp_path / "token", "t0k\n")

    async def main():
        async with harness(auth_token_file=token_file, **files) as (router, _, _, _):
            parser = generate_cmd.argparse.ArgumentParser()
            generate_cmd.add_arguments(parser)
            args = parser.parse_args(
                [
                    "--target",
                    f"127.0.0.1:{router.port}",
                    "--tokens",
                    "5,6",
                    "--show-tokens",
                    "--max-new-tokens",
                    "3",
                    "--token-file",
                    token_file,
                    "--tls-ca",
                    files["tls_client_ca_file"],
                    "--tls-cert",
                    write(tmp_path / "c.crt", client.cert),
                    "--tls-key",
                    write(tmp_path / "c.key", client.key),
                    "--token",
                    "",
                ]
            )
            assert await asyncio.to_thread(generate_cmd.run, args) == 0
            args.tls_cert = args.tls_key = ""
            assert await asyncio.to_thread(generate_cmd.run, args) == 1  # no client certificate

    asyncio.run(main())
    assert "7 8 9" in capsys.readouterr().out


def test_port_in_use_names_the_role_and_address():
    from common.errors import AddressInUseError

    async def main():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            for overrides in ({"port": port}, {"health_port": port}):
                config = RouterConfig(**{"host": "127.0.0.1", "port": 0, "metrics_port": 0, **overrides})
                with pytest.raises(AddressInUseError) as err:
                    await start_router(config, "127.0.0.1:1")
                role = "router health" if "health_port" in overrides else "router gRPC"
                assert str(err.value) == f"{role} 127.0.0.1:{port} is in use"
                assert err.value.exit_code == 7

    asyncio.run(main())


def test_metrics_port_in_use_names_the_router_and_binds_loopback_by_default(tmp_path):
    """A taken --metrics-port exits 7 with one line naming the router's metrics and the address it tried
    (loopback unless --metrics-host says otherwise)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "colibri.cli",
                "router",
                "--worker",
                "127.0.0.1:1",
                "--port",
                "0",
                "--metrics-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(repo)},
        )
    assert done.returncode == 7, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"colibri router: error: router metrics 127.0.0.1:{port} is in use"


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--chat-template", "{missing}"], "--chat-template: cannot read {missing}"),
        (["--auth-token-file", "{missing}"], "auth_token_file: cannot read {missing}"),
        (["--worker-token-file", "{missing}"], "worker_token_file: cannot read {missing}"),
        (["--tls-cert-file", "{missing}", "--tls-key-file", "{missing}", "--http-port", "0"], "{missing}"),
    ],
)
def test_a_bad_start_up_file_is_named_before_any_port_is_bound(tmp_path, flags, error):
    """A file the router reads at start-up is checked before the metrics port is bound: with that port taken
    too, the operator still gets the file's one-line error (exit 2), not 'in use' (exit 7)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    missing = str(tmp_path / "missing")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "colibri.cli", "router", "--worker", "127.0.0.1:1", "--port", "0"]
            + ["--metrics-port", str(port), *(flag.format(missing=missing) for flag in flags)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(repo)},
        )
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr
    assert last.startswith("colibri router: error: ") and error.format(missing=missing) in last, last
    assert "Traceback" not in done.stderr


def _load_setting(setting: str, path: str, key_dir):
    """Reads the file of one router setting the way start-up does."""
    from router_service.chat import ChatTemplate

    if setting == "chat_template":
        return ChatTemplate.load(None, path)
    if setting == "tls_cert_file":
        key = write(key_dir / "tls.key", issue(make_ca(), "localhost", server=True).key)
        return security.server_credentials(RouterConfig(tls_cert_file=path, tls_key_file=key))
    config = RouterConfig(**{setting: path})
    return security.public_tokens(config) if setting == "auth_token_file" else security.worker_token_source(config)


@pytest.mark.parametrize("setting", ["auth_token_file", "worker_token_file", "tls_cert_file", "chat_template"])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_file_setting_naming_no_regular_file_is_one_line_not_a_hang(tmp_path, setting, kind):
    """A FIFO there blocked the router's (or worker's) start-up in open() until a writer came, for ever, with its
    stop signals held: only SIGKILL ended it. /dev/null was read as an empty file (and /dev/zero was read without
    end: the chat template's memory grew until the process died)."""
    import threading

    from common.errors import ConfigError

    path = str(tmp_path / "file") if kind == "fifo" else os.devnull
    if kind == "fifo":
        os.mkfifo(path)
    outcome: list = []

    def load():
        try:
            outcome.append(_load_setting(setting, path, tmp_path))
        except Exception as e:
            outcome.append(e)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # let the blocked open go, so the test fails instead of hanging
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail(f"{setting}: opening a FIFO blocked start-up")
    assert len(outcome) == 1 and isinstance(outcome[0], ConfigError), outcome
    what = "a FIFO" if kind == "fifo" else "a character device"
    assert str(outcome[0]).endswith(f"cannot read {path}: not a regular file ({what})"), outcome[0]
