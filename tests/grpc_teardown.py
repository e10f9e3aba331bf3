"""The end of a test's gRPC servers and channels on its own event loop, before asyncio.run closes it.

A server's stop() returns while grpc.aio's own tasks of the calls it cut may still run: a stream handler's
wrapper sending the final status, the listener for the client's close. asyncio.run cancels what is left, but the
batches those tasks started still complete in gRPC's core, after the loop has closed: grpc's poller hands each
completion to the loop then running (a later test's) and that loop logs "Event loop is closed" at ERROR.

A test that runs a grpc.aio server on its loop ends it with `served` (start, yield the port, stop) or `stopped`
(stop servers it started itself, e.g. one it replaced mid-test); one that only ran a router or channels calls
`grpc_tasks_ended` once they are stopped and closed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

# Where grpc.aio's Cython code says its coroutines come from (server.pyx.pxi, call.pyx.pxi, ...).
GRPC_AIO_SOURCE = "grpc/_cython/_cygrpc/aio/"


def _runs_grpc_aio(task: asyncio.Task) -> bool:
    code = getattr(task.get_coro(), "cr_code", None)
    return code is not None and GRPC_AIO_SOURCE in code.co_filename


async def grpc_tasks_ended(timeout_s: float = 2.0) -> None:
    """Waits (`timeout_s` at most) until no task of grpc.aio's own runs on this loop: call once the servers are
    stopped and the channels closed, last thing before the loop ends."""
    tasks = [task for task in asyncio.all_tasks() if _runs_grpc_aio(task)]
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)


async def stopped(*servers: grpc.aio.Server, grace: float | None = 0) -> None:
    """Stops `servers` in turn (`grace` each; None: at once) and waits until grpc.aio's tasks have ended."""
    for server in servers:
        await server.stop(grace)
    await grpc_tasks_ended()


@contextlib.asynccontextmanager
async def served(server: grpc.aio.Server, grace: float | None = 0) -> AsyncIterator[int]:
    """Starts `server` (its handlers added) on a free loopback port and yields the port; on the way out stops it
    and waits for grpc.aio's tasks (`stopped`)."""
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await stopped(server, grace=grace)
