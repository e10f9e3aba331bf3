"""The HTTP front's Host check (router_service/http_hosts.py): a router on loopback answers only loopback names and
the names in allowed_hosts, so a web page that re-points its own name to 127.0.0.1 (DNS rebinding) cannot drive it
from a browser; a router on another address takes any Host unless allowed_hosts is set. Raw requests on a socket,
for the Host headers a browser would send after a rebinding."""

from __future__ import annotations

import asyncio

import pytest

from common.config import resolve
from common.errors import ConfigError
from router_service.config import RouterConfig
from router_service.http_hosts import HostCheck, allowed_hosts_problem, host_name
from tests.router_service.test_http_errors import (
    AUTH_LINE,
    COMPLETIONS,
    assert_openai_error,
    http_harness,
    problems,
    raw_exchange,
    status_and_body,
)

BODY = b'{"prompt": "x", "max_tokens": 1}'
FORGED = [
    "evil.example",
    "evil.example:8000",
    "127.0.0.1.evil.example",
    "localhost.evil.example",
    "localhost.evil.example:8000",
    "[2001:db8::1]",
    "[2001:db8::1]:8000",
    "[::2]",
    "10.0.0.1",
    "::1",  # an IPv6 address outside brackets is no Host
    "localhost:80:80",
    "localhost:http",
    "localhost.",
    "127.1",
    "",
    "*.localhost",
]
LOOPBACK = [
    "localhost",
    "LOCALHOST",
    "localhost:8000",
    "app.localhost:8000",
    "127.0.0.1",
    "127.8.9.10:1",
    "[::1]",
    "[::1]:8000",
    "[0:0::1]",
    "[::ffff:127.0.0.1]",
]


def get(path: str, host: str | None, version: str = "1.1") -> bytes:
    host_line = b"" if host is None else b"Host: " + host.encode() + b"\r\n"
    return f"GET {path} HTTP/{version}\r\n".encode() + host_line + b"Connection: close\r\n\r\n"


def post(host: str, headers: bytes = b"") -> bytes:
    return (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n".encode()
        + AUTH_LINE
        + headers
        + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(BODY)
        + BODY
    )


async def answers(port: int, requests: list[bytes]) -> list[tuple[int, dict | None]]:
    return [status_and_body(await raw_exchange(port, request)) for request in requests]


def assert_refused(status: int, answer, host_shown: str) -> None:
    assert_openai_error(answer, 403, status, code="host_not_allowed")
    message = answer["error"]["message"]
    assert message.startswith(f"Host header: {host_shown} ") and "allowed_hosts" in message, message


def test_a_loopback_router_refuses_hosts_that_are_not_loopback_names(tmp_path, caplog):
    """Before the check a page on evil.example, re-pointed to 127.0.0.1, was answered as if it were the router's
    own origin: health, models and completions alike."""

    async def body():
        async with http_harness(tmp_path) as (router, _fake, _base, _hooks):
            for host in FORGED:
                for request in (get("/health", host), get("/v1/models", host), post(host)):
                    (status, answer), *_ = await answers(router.http_port, [request])
                    assert_refused(status, answer, repr(host))
            assert not problems(caplog)

    asyncio.run(body())


def test_a_loopback_router_answers_loopback_names(tmp_path, caplog):
    async def body():
        async with http_harness(tmp_path) as (router, _fake, _base, _hooks):
            for host in LOOPBACK:
                for request in (get("/health", host), post(host)):
                    (status, answer), *_ = await answers(router.http_port, [request])
                    assert status == 200, (host, answer)
            assert not problems(caplog)

    asyncio.run(body())


def test_an_http_1_0_request_without_host_is_refused_on_loopback(tmp_path, caplog):
    async def body():
        async with http_harness(tmp_path) as (router, _fake, _base, _hooks):
            (status, answer), *_ = await answers(router.http_port, [get("/health", None, "1.0")])
            assert_refused(status, answer, "none")
            (status, _), *_ = await answers(router.http_port, [get("/health", "localhost", "1.0")])
            assert status == 200

    asyncio.run(body())


def test_an_absolute_form_target_names_the_host(tmp_path, caplog):
    """RFC 9112 has a server take the authority of an absolute-form target over the Host header."""

    async def body():
        async with http_harness(tmp_path) as (router, _fake, _base, _hooks):
            forged, plain = get("http://evil.example/health", "localhost"), get("http://localhost:1/health", "x")
            (status, answer), (plain_status, _) = await answers(router.http_port, [forged, plain])
            assert_refused(status, answer, repr("http://evil.example/health"))
            assert plain_status == 200

    asyncio.run(body())


def test_a_refused_host_is_never_invited_to_send_its_body(tmp_path, caplog):
    async def body():
        async with http_harness(tmp_path) as (router, _fake, _base, _hooks):
            raw = await raw_exchange(router.http_port, post("evil.example", b"Expect: 100-continue\r\n"))
            assert raw.startswith(b"HTTP/1.1 403 "), raw
            assert b"\r\nconnection: close" in raw.lower()

    asyncio.run(body())


def test_allowed_hosts_adds_names_on_loopback(tmp_path, caplog):
    async def body():
        allowed = ("Colibri.internal", "*.example.com", "[2001:db8::1]")
        async with http_harness(tmp_path, allowed_hosts=allowed) as (router, _fake, _base, _hooks):
            taken = ["colibri.internal:8000", "a.example.com", "b.a.example.com:1", "[2001:db8:0::1]", "localhost"]
            got = await answers(router.http_port, [get("/health", host) for host in taken])
            assert [status for status, _ in got] == [200] * len(taken), got
            for host in ("example.com", "evil.example", "colibri.internal.evil.example", "aexample.com"):
                (status, answer), *_ = await answers(router.http_port, [get("/health", host)])
                assert_refused(status, answer, repr(host))

    asyncio.run(body())


def test_a_star_turns_the_check_off(tmp_path, caplog):
    async def body():
        async with http_harness(tmp_path, allowed_hosts=("*",)) as (router, _fake, _base, _hooks):
            got = await answers(router.http_port, [get("/health", "evil.example"), get("/health", None, "1.0")])
            assert [status for status, _ in got] == [200, 200], got

    asyncio.run(body())


def test_a_router_on_every_interface_takes_any_host_unless_allowed_hosts_is_set(tmp_path, caplog):
    """Its clients reach it by names of its own (a Kubernetes Service's): the list, once set, applies there too."""

    async def body():
        async with http_harness(tmp_path, host="0.0.0.0") as (router, _fake, _base, _hooks):
            got = await answers(router.http_port, [get("/health", "colibri.default.svc"), post("evil.example")])
            assert [status for status, _ in got] == [200, 200], got
        async with http_harness(tmp_path, host="0.0.0.0", allowed_hosts=("colibri.default.svc",)) as (router, *_):
            got = await answers(router.http_port, [get("/health", "colibri.default.svc:8000"), post("localhost")])
            assert [status for status, _ in got] == [200, 200], got
            (status, answer), *_ = await answers(router.http_port, [post("evil.example")])
            assert_refused(status, answer, repr("evil.example"))

    asyncio.run(body())


@pytest.mark.parametrize(
    "bound, enforced",
    [
        (["127.0.0.1"], True),
        (["127.0.0.1", "::1"], True),  # localhost
        (["::ffff:127.0.0.1"], True),
        (["::"], False),
        (["0.0.0.0"], False),
        (["127.0.0.1", "10.0.0.1"], False),
        (["fe80::1%eth0"], False),
    ],
)
def test_the_check_is_on_by_default_only_where_every_bound_address_is_loopback(bound, enforced):
    assert HostCheck.for_listener((), bound).enforced is enforced
    assert HostCheck.for_listener(("a.example",), bound).enforced is True
    assert HostCheck.for_listener(("a.example", "*"), bound).enforced is False


@pytest.mark.parametrize(
    "value, name",
    [("LocalHost:80", "localhost"), ("[::1]:8000", "::1"), ("a.b", "a.b"), ("a b", None), ("[::1", None)],
)
def test_host_name_reads_a_host_header(value, name):
    assert host_name(value) == name


@pytest.mark.parametrize(
    "values",
    [["http://colibri.internal"], ["colibri.internal:8000"], ["colibri.internal/v1"], ["a b"], ["a.*.example"], ["*x"]],
)
def test_bad_allowed_hosts_are_refused_at_start_in_one_line(values):
    assert allowed_hosts_problem(values) is not None
    with pytest.raises(ConfigError) as error:
        RouterConfig(allowed_hosts=tuple(values))
    message = str(error.value)
    assert message.startswith("router: allowed_hosts ") and "\n" not in message, message
    with pytest.raises(ConfigError):
        resolve(RouterConfig, env={"COLIBRI_ALLOWED_HOSTS": ",".join(["localhost", *values])})


def test_allowed_hosts_is_read_as_a_list_from_every_source():
    config = resolve(RouterConfig, env={"COLIBRI_ALLOWED_HOSTS": "a.example, *.b.example,[::1]"})
    assert [host.strip() for host in config.allowed_hosts] == ["a.example", "*.b.example", "[::1]"]
    config = resolve(RouterConfig, file_values={"allowed_hosts": ["a.example", "*"]}, env={})
    assert config.allowed_hosts == ("a.example", "*")
