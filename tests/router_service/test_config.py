"""RouterConfig: a duration too long for gRPC (which takes milliseconds in a 32-bit int, and fails a call at once
whose deadline is past ~300 years) is refused in one line naming it."""

from __future__ import annotations

import asyncio
import re

import pytest

from common.config import resolve
from common.errors import ConfigError
from router_service.config import MAX_DURATION_S, RouterConfig
from router_service.main import start_router
from tests.grpc_teardown import grpc_tasks_ended

DURATIONS = ("request_timeout_s", "worker_step_timeout_s", "queue_timeout_s", "drain_timeout_s", "retry_after_s")


@pytest.mark.parametrize("name", DURATIONS)
@pytest.mark.parametrize("value", [float("inf"), 3e6, 1e12])
def test_a_duration_past_the_longest_is_refused(name, value):
    """request_timeout_s=3e6 stopped the router with an OverflowError traceback (a gRPC channel argument), inf with
    another; worker_step_timeout_s=1e12 failed every worker call at once with DEADLINE_EXCEEDED."""
    with pytest.raises(ConfigError, match=rf"^router: {name} must be at most {MAX_DURATION_S} seconds") as error:
        RouterConfig(**{name: value})
    assert "\n" not in str(error.value)


def test_the_longest_durations_start_a_router():
    async def main():
        config = RouterConfig(
            **{"host": "127.0.0.1", "port": 0, "metrics_port": 0, **dict.fromkeys(DURATIONS, MAX_DURATION_S)}
        )
        router = await start_router(config, "127.0.0.1:1")
        await router.stop(0.1)
        await grpc_tasks_ended()

    asyncio.run(main())


@pytest.mark.parametrize("env", [{"COLIBRI_LOG_LEVEL": "debug"}, {"LOG_LEVEL": "debug"}])
def test_the_log_level_comes_from_either_variable_the_worker_reads(env):
    """The router read LOG_LEVEL alone, while the worker (and docs/configuration.md) also took COLIBRI_LOG_LEVEL:
    one deployment setting left the two services at different levels."""
    assert resolve(RouterConfig, env=env).log_level == "debug"
    assert resolve(RouterConfig, env={}).log_level == "INFO"


@pytest.mark.parametrize("name", ["max_message_bytes", "worker_max_message_bytes"])
@pytest.mark.parametrize("value", [0, 1, 1023, 2**31, 2**40])
def test_a_message_limit_grpc_cannot_take_is_refused(name, value):
    """2^31 stopped the router with an OverflowError traceback (gRPC takes the limit as a 32-bit int); 1 byte
    started a router that refused every message. The worker already refused its own outside [1024, 2^31)."""
    with pytest.raises(ConfigError, match=rf"^router: {name} must be in \[1024, 2\^31\), got {value}$"):
        RouterConfig(**{name: value})


@pytest.mark.parametrize(
    "address", ["localhost:50052", "10.0.0.7:1", "[::1]:50052", "unix:/tmp/w.sock", "unix:///tmp/w.sock", "dns:///w:5"]
)
def test_worker_addresses_grpc_can_reach_are_taken(address):
    assert RouterConfig(worker=address).worker == address


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("worker host:50052", "an address has no whitespace"),
        ("localhost:50052 ", "an address has no whitespace"),
        ("localhost", "expected HOST:PORT or unix:PATH"),
        (":50052", "expected HOST:PORT or unix:PATH"),
        ("localhost:0", "port '0' is not in [1, 65535]"),
        ("localhost:http", "port 'http' is not in [1, 65535]"),
        ("localhost:70000", "port '70000' is not in [1, 65535]"),
        ("::1:50052", "an IPv6 host goes in brackets ([::1]:PORT)"),
        # an empty address list, retried for ever
        ("unix:", "nothing after 'unix:' (e.g. unix:/ABSOLUTE/PATH)"),
        ("unix://", "nothing after 'unix:' (e.g. unix:/ABSOLUTE/PATH)"),
        ("dns:///", "nothing after 'dns:' (e.g. unix:/ABSOLUTE/PATH)"),
        # named an IPv6 host
        ("http://worker:50052", "a URL; gRPC takes HOST:PORT or unix:PATH (schemes: unix:, unix-abstract:, dns:, ipv4:, ipv6:, vsock:)"),
        ("grpc://worker:50052", "a URL; gRPC takes HOST:PORT or unix:PATH (schemes: unix:, unix-abstract:, dns:, ipv4:, ipv6:, vsock:)"),
    ],
)  # fmt: skip
def test_a_worker_address_grpc_would_wait_on_forever_is_refused(address, problem):
    """A space in --worker, or a host without a port (gRPC dials HOST:443), left the router "waiting for the worker"
    for ever."""
    with pytest.raises(ConfigError, match="^" + re.escape(f"router: worker {address!r}: {problem}") + "$"):
        RouterConfig(worker=address)


def test_the_http_body_budget_is_set_like_its_neighbours_and_fits_a_largest_body():
    """http_max_body_bytes_in_flight comes from the environment, a config file or its flag; 0 (the default) is 4
    bodies of max_message_bytes, following it; below max_message_bytes a body the router accepts could never be
    read, so that is refused in one line naming both."""
    assert RouterConfig().http_max_body_bytes_in_flight == 0 and RouterConfig().http_body_budget_bytes == 64 << 20
    assert RouterConfig(max_message_bytes=128 << 20).http_body_budget_bytes == 512 << 20  # a raised limit still starts
    assert RouterConfig(http_max_body_bytes_in_flight=20 << 20).http_body_budget_bytes == 20 << 20
    env = {"COLIBRI_HTTP_MAX_BODY_BYTES_IN_FLIGHT": str(64 << 20)}
    assert resolve(RouterConfig, env=env).http_max_body_bytes_in_flight == 64 << 20
    file_values = {"http_max_body_bytes_in_flight": 32 << 20}
    assert resolve(RouterConfig, file_values=file_values, env={}).http_max_body_bytes_in_flight == 32 << 20
    flags = {"http_max_body_bytes_in_flight": 16 << 20}
    assert resolve(RouterConfig, env=env, flags=flags).http_max_body_bytes_in_flight == 16 << 20
    message = "router: http_max_body_bytes_in_flight (1048576) must be >= max_message_bytes (16777216)"
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        RouterConfig(http_max_body_bytes_in_flight=1 << 20)
    assert RouterConfig(max_message_bytes=1 << 20, http_max_body_bytes_in_flight=1 << 20)
    with pytest.raises(ConfigError, match=r"^router: http_max_body_bytes_in_flight must be >= 0, got -1$"):
        RouterConfig(http_max_body_bytes_in_flight=-1)


@pytest.mark.parametrize("scheme", ["unix:", "unix://"])
def test_a_worker_socket_path_too_long_is_refused(scheme):
    """gRPC cannot open such a socket: the router logged 'cannot use the worker' and retried for ever."""
    path = "/run/" + "w" * 110 + ".sock"
    with pytest.raises(ConfigError) as error:
        RouterConfig(worker=scheme + path)
    assert str(error.value) == (
        f"router: worker {scheme + path!r}: {path} is {len(path)} bytes long; a Unix socket path holds at most 107"
    )


def test_a_worker_socket_path_of_the_longest_length_is_taken():
    assert RouterConfig(worker="unix:/" + "w" * 106).worker == "unix:/" + "w" * 106
