"""The router's gRPC ports hold at most grpc_max_connections connections each: gRPC core closes a connection opened
past the cap as it opens (its client's call fails UNAVAILABLE), while the connections already open are served and a
place frees when one closes. Raw TCP connections that never speak count too, so a flood of them cannot exhaust the
router's descriptors; one silent past the handshake timeout, or idle past the idle timeout, gives its place back.
The open-file limit is raised for every port's cap together. The setting is a positive integer gRPC core can take,
refused in one line otherwise."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from common import connection_limits
from common.config import resolve
from common.errors import ConfigError
from common.metrics import new_registry
from router_service.config import RouterConfig
from router_service.observability import router_metrics
from tests.helpers import free_port, serve_env
from tests.router_service.fake_worker import harness

# Each channel its own connection: channels of one process otherwise share one per target.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


async def check(port: int) -> tuple[grpc.aio.Channel, grpc.StatusCode]:
    """A fresh connection's health check: (its channel, left open, and how the call ended)."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN_CONNECTION)
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return channel, grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return channel, e.code()


async def closed_by_server(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the router closes this raw connection (which never speaks) within `timeout`; it may have sent its
    HTTP/2 settings and a GOAWAY first."""
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        await asyncio.wait_for(reader.read(), timeout)
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    finally:
        writer.close()


async def served_within(port: int, timeout: float) -> bool:
    """Whether a fresh connection is served within `timeout` (its channel closed)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        channel, code = await check(port)
        await channel.close()
        if code == grpc.StatusCode.OK or asyncio.get_running_loop().time() > deadline:
            return code == grpc.StatusCode.OK
        await asyncio.sleep(0.2)


def test_the_connection_gauges_count_each_port_open_connections():
    """colibri_grpc_connections follows the public port's open connections (channelz's count) up to the cap, which a
    refused connection never joins; the health port's are counted apart."""
    registry = new_registry()
    hooks, _ = router_metrics("m", -1, registry)

    def connections(port: str) -> float | None:
        name = "colibri_grpc_connections" if port == "grpc" else "colibri_grpc_health_connections"
        return registry.get_sample_value(name, {"model_name": "m"})

    async def body():
        async with harness(hooks=hooks, grpc_max_connections=3, health_port=free_port()) as (router, _, _, channel):
            await channel.close()  # the harness's own channel (never connected): this test counts its own
            held = [await check(router.port) for _ in range(3)]  # the cap
            assert connections("grpc") == 3 and connections("health") == 0
            extra, code = await check(router.port)
            assert code == grpc.StatusCode.UNAVAILABLE
            assert connections("grpc") == 3
            probe, _ = await check(router.health_port)
            assert connections("health") == 1
            for c in [extra, probe] + [c for c, _ in held]:
                await c.close()
        # a scrape after the servers stopped (channelz forgot them) reads 0: it raised and failed the whole scrape
        assert connections("grpc") == 0 and connections("health") == 0

    asyncio.run(body())


def test_past_the_cap_a_connection_is_closed_and_the_open_ones_are_served():
    async def body():
        async with harness(grpc_max_connections=3, health_port=free_port()) as (router, _, _, channel):
            await channel.close()  # the harness's own channel: this test counts its connections itself
            held = [await check(router.port) for _ in range(3)]
            assert [code for _, code in held] == [grpc.StatusCode.OK] * 3
            extra, code = await check(router.port)
            assert code == grpc.StatusCode.UNAVAILABLE
            await extra.close()
            # the connections already open are still served
            answer = await health_pb2_grpc.HealthStub(held[0][0]).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            # the health port has a cap of its own: the full RPC port does not shut the probes out
            probe, code = await check(router.health_port)
            assert code == grpc.StatusCode.OK
            await probe.close()
            # a place frees when a connection closes
            await held.pop()[0].close()
            assert await served_within(router.port, 5.0)
            for c, _ in held:
                await c.close()

    asyncio.run(body())


def test_silent_tcp_connections_count_and_the_ones_past_the_cap_are_closed_at_once():
    async def body():
        async with harness(grpc_max_connections=2) as (router, _, _, channel):
            await channel.close()
            silent = [socket.create_connection(("127.0.0.1", router.port)) for _ in range(2)]
            await asyncio.sleep(0.2)  # the router has taken them
            extra = socket.create_connection(("127.0.0.1", router.port))
            assert await closed_by_server(extra, 5.0)
            blocked, code = await check(router.port)
            assert code == grpc.StatusCode.UNAVAILABLE
            await blocked.close()
            for s in silent:
                s.close()
            assert await served_within(router.port, 5.0)

    asyncio.run(body())


def test_a_connection_silent_past_the_handshake_timeout_gives_its_place_back(monkeypatch):
    # long enough that the check below still meets the silent connection on a loaded machine (two cores, four
    # test processes): at 500 ms a stall of 0.4 s let the place free first and the refusal expected never came
    monkeypatch.setattr(connection_limits, "GRPC_HANDSHAKE_TIMEOUT_MS", 2000)

    async def body():
        async with harness(grpc_max_connections=1) as (router, _, _, channel):
            await channel.close()
            silent = socket.create_connection(("127.0.0.1", router.port))
            await asyncio.sleep(0.1)
            blocked, code = await check(router.port)
            assert code == grpc.StatusCode.UNAVAILABLE  # the silent one holds the only place...
            await blocked.close()
            assert await closed_by_server(silent, 5.0)  # ...until its handshake times out
            assert await served_within(router.port, 5.0)

    asyncio.run(body())


def test_an_idle_connection_gives_its_place_back_and_its_client_reconnects(monkeypatch):
    monkeypatch.setattr(connection_limits, "GRPC_IDLE_TIMEOUT_MS", 500)

    async def body():
        async with harness(grpc_max_connections=1) as (router, _, _, channel):
            await channel.close()
            idle, code = await check(router.port)
            assert code == grpc.StatusCode.OK
            # no call: the router sends it GOAWAY and the place frees
            assert await served_within(router.port, 10.0)
            # its client reconnects on its next call; the probe's connection above may not be seen closed yet (the
            # cap is 1), so the call waits for the channel to be ready rather than failing on one refused attempt
            stub = health_pb2_grpc.HealthStub(idle)
            answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=15, wait_for_ready=True)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            await idle.close()

    asyncio.run(body())


FIT = """
import asyncio, resource, sys
from router_service.config import RouterConfig
from router_service.main import start_router
resource.setrlimit(resource.RLIMIT_NOFILE, (300, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
config = RouterConfig(
    host="127.0.0.1", port=0, metrics_port=0, worker="127.0.0.1:1", health_port=int(sys.argv[1]),
    http_port=int(sys.argv[2]), grpc_max_connections=1000, http_max_connections=500,
)
async def main():
    router = await start_router(config)
    print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    await router.stop(0.1)
asyncio.run(main())
"""


def test_the_open_file_limit_fits_every_port_s_cap():
    """Two gRPC ports of 1000 and an HTTP port of 500, plus the reserve: the HTTP cap alone undercounted them."""
    import resource

    need = 2 * 1000 + 500 + connection_limits.FD_RESERVE
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < need:
        pytest.skip(f"the hard open-file limit is under {need}")
    done = subprocess.run(
        [sys.executable, "-c", FIT, str(free_port()), str(free_port())],
        env=serve_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) == need


@pytest.mark.parametrize("value", [0, -1, 2**20 + 1, 2**31])
def test_a_cap_grpc_cannot_take_is_refused_in_one_line(value):
    with pytest.raises(ConfigError, match=r"^router: grpc_max_connections must be in \[1, 1048576\]") as error:
        RouterConfig(grpc_max_connections=value)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="grpc_max_connections"):
        resolve(RouterConfig, env={"COLIBRI_GRPC_MAX_CONNECTIONS": str(value)})
    assert resolve(RouterConfig, env={"COLIBRI_GRPC_MAX_CONNECTIONS": "7"}).grpc_max_connections == 7


def _broken(*_args):
    raise RuntimeError("channelz changed")


@pytest.mark.parametrize(
    "servers, sockets",
    [
        (_broken, None),  # listing servers fails: at start-up
        (lambda _start: '{"server": [{"ref": {}}]}', None),  # a JSON of another shape: at start-up
        (None, _broken),  # listing a server's sockets fails: at a scrape
        (None, lambda *_args: '{"socketRef": [{"id": 1}]}'),  # a JSON of another shape: at a scrape
    ],
)
def test_a_failing_channelz_never_fails_a_start_up_or_a_scrape(monkeypatch, servers, sockets):
    """The gauges read grpcio's private channelz: whatever it raises, the router starts and a scrape reads 0 (only a
    stopped server's ValueError was caught; anything else failed start-up or every scrape)."""
    from common import grpc_connections

    if servers is not None:
        monkeypatch.setattr(grpc_connections, "_get_servers", servers)
    if sockets is not None:
        monkeypatch.setattr(grpc_connections, "_get_server_sockets", sockets)
    registry = new_registry()
    hooks, _ = router_metrics("m", -1, registry)

    async def body():
        async with harness(hooks=hooks, health_port=free_port()) as (router, _, _, channel):
            await channel.close()
            held, code = await check(router.port)
            assert code == grpc.StatusCode.OK
            text = await asyncio.to_thread(lambda: generate_latest(registry).decode())
            await held.close()
            return text

    text = asyncio.run(body())
    assert 'colibri_grpc_connections{model_name="m"} 0.0' in text
