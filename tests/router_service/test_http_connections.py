"""The HTTP port holds at most http_max_connections connections: past the cap a new connection gets a one-line
503 (`code: too_many_connections`, `Retry-After`, `Connection: close`) and is closed, counted in
colibri_http_connections_refused_total; connections held idle or trickling their headers are closed by
http_header_timeout_s, which frees their places. Nothing is logged at ERROR, and the router keeps serving."""

from __future__ import annotations

import asyncio
import json
import ssl

import aiohttp

from router_service import http_connections
from tests.router_service.certs import issue, make_ca
from tests.router_service.fake_worker import wait_for
from tests.router_service.test_http_errors import AUTH, http_harness, problems
from tests.router_service.test_http_timeouts import closed_by_server


def refused(hooks) -> float:
    return hooks.m.http_connections_refused._value.get()


def open_now(hooks) -> float:
    """colibri_http_connections as a scrape reads it."""
    return hooks.m.http_connections.collect()[0].samples[0].value


async def open_idle(port: int, n: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]
    await asyncio.sleep(0.1)  # the router has taken them all
    return connections


async def refusal(port: int) -> tuple[bytes, dict]:
    """What the router says to a connection past its cap: it sends it unasked, and closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        raw = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return head, json.loads(body)


def test_past_the_cap_a_connection_gets_503_and_is_closed(tmp_path, caplog):
    async def body():
        async with http_harness(tmp_path, http_max_connections=4) as (router, fake, base, hooks):
            held = await open_idle(router.http_port, 4)
            assert open_now(hooks) == 4
            head, error = await refusal(router.http_port)
            assert head.startswith(b"HTTP/1.1 503 "), head
            assert b"connection: close" in head.lower() and b"retry-after: 1" in head.lower(), head
            assert error["error"]["code"] == "too_many_connections", error
            assert error["error"]["type"] == "server_error" and "http_max_connections" in error["error"]["message"]
            assert "\n" not in error["error"]["message"]
            assert refused(hooks) == 1
            # a place frees when a connection closes: the next one is served
            held.pop()[1].close()
            await asyncio.sleep(0.1)
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.get(base + "/v1/models") as r:
                    assert r.status == 200
            for _, writer in held:
                writer.close()
            await asyncio.sleep(0.1)
            assert open_now(hooks) == 0
            assert not problems(caplog)

    asyncio.run(body())


def test_a_flood_of_idle_and_trickling_connections_holds_at_most_the_cap_until_the_header_timeout(tmp_path, caplog):
    """A slowloris: 300 connections at once, half idle, half sending a header line now and then. The router holds
    8 of them, refuses the rest at once, and closes the 8 by http_header_timeout_s; then it serves again."""

    async def body():
        async with http_harness(tmp_path, http_max_connections=8, http_header_timeout_s=1.0) as (
            router,
            fake,
            base,
            hooks,
        ):
            loop = asyncio.get_running_loop()
            connections = []
            for _ in range(300):
                try:
                    connections.append(await asyncio.open_connection("127.0.0.1", router.http_port))
                except OSError:  # the listen backlog may fill while the router refuses: a refusal too
                    pass
            for i, (_, writer) in enumerate(connections):
                if i % 2:
                    writer.write(b"POST /v1/completions HTTP/1.1\r\n")

            async def trickle():
                for _ in range(10):
                    await asyncio.sleep(0.2)
                    for i, (_, writer) in enumerate(connections):
                        if i % 2 and not writer.is_closing():
                            writer.write(b"X-Slow: 1\r\n")

            trickling = asyncio.ensure_future(trickle())
            await asyncio.sleep(0.3)
            assert open_now(hooks) <= 8
            deadline = loop.time() + 6
            closed = await asyncio.gather(*(closed_by_server(r, deadline) for r, _ in connections))
            assert all(closed), f"{closed.count(False)} connections still open"
            assert refused(hooks) >= len(connections) - 8
            trickling.cancel()
            for _, writer in connections:
                writer.close()
            await asyncio.sleep(0.1)
            assert open_now(hooks) == 0
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
            assert not problems(caplog)

    asyncio.run(body())


def test_requests_on_open_connections_are_served_at_the_cap(tmp_path, caplog):
    """The cap counts connections, not requests: keep-alive connections at the cap keep being served."""

    async def body():
        async with http_harness(tmp_path, http_max_connections=2) as (router, fake, base, hooks):
            connector = aiohttp.TCPConnector(limit=2)
            async with aiohttp.ClientSession(headers=AUTH, connector=connector) as s:

                async def one():
                    async with s.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
                        return r.status

                assert await asyncio.gather(*(one() for _ in range(20))) == [200] * 20
            assert refused(hooks) == 0 and not problems(caplog)

    asyncio.run(body())


def test_over_tls_the_cap_counts_and_a_stalled_handshake_is_closed_by_the_header_timeout(tmp_path, caplog):
    """With TLS the port is served by the same gate: requests are served, a connection past the cap gets its
    refusal, and one that never starts its handshake is closed by http_header_timeout_s."""

    async def body():
        ca = make_ca()
        pair = issue(ca, "localhost", server=True)
        (tmp_path / "tls.crt").write_bytes(pair.cert)
        (tmp_path / "tls.key").write_bytes(pair.key)
        settings = dict(
            tls_cert_file=str(tmp_path / "tls.crt"),
            tls_key_file=str(tmp_path / "tls.key"),
            http_max_connections=2,
            http_header_timeout_s=1.0,
        )
        async with http_harness(tmp_path, **settings) as (router, fake, base, hooks):
            trust = ssl.create_default_context(cadata=ca.cert.decode())
            url = f"https://127.0.0.1:{router.http_port}/v1/models"
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.get(url, ssl=trust) as r:
                    assert r.status == 200
            await asyncio.sleep(0.1)
            silent = await asyncio.open_connection("127.0.0.1", router.http_port)  # no ClientHello
            held = [await asyncio.open_connection("127.0.0.1", router.http_port, ssl=trust) for _ in range(2)]
            await asyncio.sleep(0.1)
            assert open_now(hooks) == 2
            reader, writer = await asyncio.open_connection("127.0.0.1", router.http_port, ssl=trust)
            raw = await asyncio.wait_for(reader.read(), 5)
            assert raw.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in raw, raw
            writer.close()
            loop = asyncio.get_running_loop()
            assert await closed_by_server(silent[0], loop.time() + 5)
            for _, writer in [silent, *held]:
                writer.close()
            assert refused(hooks) == 1 and not problems(caplog)

    asyncio.run(body())


def test_refused_connections_linger_briefly_and_few_at_once(tmp_path, caplog):
    """A refused connection is kept open a moment so that its answer is not lost to a reset, but a flood of them
    holds at most MAX_LINGERING descriptors, and each lingers at most REFUSAL_LINGER_S."""

    async def body():
        async with http_harness(tmp_path, http_max_connections=1) as (router, fake, base, hooks):
            held = await open_idle(router.http_port, 1)
            flood = await open_idle(router.http_port, 150)  # never read, never closed by the client
            gate = router.http._gate
            assert 0 < len(gate._refused) <= http_connections.MAX_LINGERING
            loop = asyncio.get_running_loop()
            deadline = loop.time() + http_connections.REFUSAL_LINGER_S + 2
            assert all(await asyncio.gather(*(closed_by_server(r, deadline) for r, _ in flood)))  # answered, FIN
            await wait_for(lambda: not gate._refused, http_connections.REFUSAL_LINGER_S + 2)
            assert refused(hooks) == 150 and open_now(hooks) == 1
            for _, writer in held + flood:
                writer.close()
            assert not problems(caplog)

    asyncio.run(body())
