"""Chat templates render in child processes, each render within a time budget.

A template from a model hub is untrusted code. Jinja's sandbox bounds what it can reach, not how long it runs:
nested loops over `range`, or one huge `**` (which holds the GIL, so even a thread would stall the router's event
loop), keep a render going for minutes, and a thread cannot be stopped. So renders run in up to `processes` child
interpreters (`python -m router_service.chat_render`), one render at a time each. A render past `timeout_s` kills
its child (the next render starts a new one) and fails as an InvalidRequestError; so does a child that dies (its
address space is capped at RENDER_MEMORY_BYTES, so a memory bomb fails there alone). A render's time counts from
when its child has it: waiting for a free child or for one to start is not part of the budget.

Each child is driven by one daemon thread doing blocking pipe I/O, so nothing here belongs to an event loop and
nothing has to be closed for the process to exit; a child exits when its stdin closes. Frames are JSON (UTF-8,
surrogates passed through) behind a 4-byte big-endian length.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

from common.errors import InvalidRequestError
from common.rate_limited_log import RateLimitedLog
from router_service import errors
from router_service.call_deadline import check_call_deadline
from router_service.chat import ChatTemplate

log = logging.getLogger("colibri.router.chat")
RENDER_MEMORY_BYTES = 2 << 30  # a child's address space: far above a real render, far below the pod's memory
START_TIMEOUT_S = 60.0  # a child's interpreter start and template compile (a loaded box is slow)
PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


class RendererFailed(Exception):
    """A child could not start or answer (its error is logged where it happened)."""


def _write_frame(pipe, value) -> None:
    data = json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    pipe.write(struct.pack(">I", len(data)) + data)
    pipe.flush()


def _read_frame(pipe):
    header = pipe.read(4)
    if len(header) < 4:
        raise EOFError("the chat template renderer closed its pipe")
    data = pipe.read(struct.unpack(">I", header)[0])
    return json.loads(data.decode("utf-8", "surrogatepass"))


class _Child:
    """One renderer process and the daemon thread that talks to it; `submit` hands it a request."""

    def __init__(self, init: dict, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.ready = loop.create_future()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._killed = False
        threading.Thread(target=self._run, args=(init,), name="chat-render", daemon=True).start()

    def submit(self, request: dict) -> asyncio.Future:
        future = self.loop.create_future()
        self._jobs.put((request, future))
        return future

    def kill(self) -> None:
        """Ends the child at once (its thread then sees the pipe close and exits)."""
        with self._lock:
            self._killed = True
            proc = self._proc
        self._jobs.put(None)
        if proc is not None and proc.poll() is None:
            proc.kill()

    def _settle(self, future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
        def settle():
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody waits for the answer any more
            pass

    def _run(self, init: dict) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
        try:
            with self._lock:
                if self._killed:
                    raise OSError("stopped before it started")
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "router_service.chat_render"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=env,
                )
            _write_frame(self._proc.stdin, init)
            _read_frame(self._proc.stdout)
        except (OSError, EOFError, ValueError) as e:
            self._settle(self.ready, error=RendererFailed(f"the chat template renderer did not start: {e}"))
            self._stop()
            return
        self._settle(self.ready, True)
        while (job := self._jobs.get()) is not None:
            request, future = job
            try:
                _write_frame(self._proc.stdin, request)
                self._settle(future, _read_frame(self._proc.stdout))
            except (OSError, EOFError, ValueError) as e:
                self._settle(future, error=RendererFailed(str(e)))
                break
        self._stop()

    def _stop(self) -> None:
        self.kill()
        if self._proc is not None:
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is None:  # never: both are PIPEs
                    continue
                try:
                    pipe.close()
                except OSError:
                    pass
            self._proc.wait()


class TemplateRenderer:
    """Renders a ChatTemplate in up to `processes` children, each render within `timeout_s` seconds; a child that
    will not start is Unavailable with the router's `retry_after_s`, as its other Unavailable answers."""

    def __init__(self, template: ChatTemplate, timeout_s: float, processes: int, retry_after_s: float = 1.0):
        self.template, self.timeout_s, self.retry_after_s = template, timeout_s, retry_after_s
        self._init = {"source": template.source, "special_tokens": template.special_tokens, "origin": template.origin}
        self._slots = asyncio.Semaphore(processes)
        self._idle: list[_Child] = []
        self._children: set[_Child] = set()
        self._slow = RateLimitedLog(log)
        weakref.finalize(self, _kill_all, self._children)

    async def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """ChatTemplate.render, in a child. Raises InvalidRequestError (the template's errors, a render past the
        budget) or errors.Unavailable (a child that would not start)."""
        request = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "template_kwargs": template_kwargs,
            "tools": tools,
        }
        check_call_deadline("chat template render")
        await self._slots.acquire()
        # The render owns its slot until its child is free again, even when the caller is cancelled: a child
        # still rendering for a departed caller is not handed to the next one, and no more than `processes` run.
        # A caller gone (or past its deadline) before its child takes the request costs no render.
        waiting: list[asyncio.Future] = []
        task = asyncio.ensure_future(self._render(request, lambda: not waiting[0].cancelled()))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved when nobody awaits it
        waiting.append(asyncio.shield(task))
        return await waiting[0]

    async def _render(self, request: dict, wanted: Callable[[], bool]) -> str:
        try:
            if not wanted():
                raise asyncio.CancelledError
            check_call_deadline("chat template render")  # the slot may have been waited for
            child = self._idle.pop() if self._idle else await self._start()
            answer = child.submit(request)
            try:
                async with asyncio.timeout(self.timeout_s):
                    reply = await answer
            except TimeoutError:
                self._discard(child)
                self._slow.warning(
                    "a chat template render took longer than %g s (chat_template_timeout_s): "
                    "its process was killed and the request refused",
                    self.timeout_s,
                )
                raise InvalidRequestError(
                    "messages",
                    f"the chat template did not finish rendering within {self.timeout_s:g} s (chat_template_timeout_s)",
                ) from None
            except RendererFailed:
                self._discard(child)
                raise InvalidRequestError(
                    "messages", "the chat template's renderer stopped during the render (out of memory?)"
                ) from None
            self._idle.append(child)
        finally:
            self._slots.release()
        if "error" in reply:
            raise InvalidRequestError(reply["field"], reply["error"])
        return reply["text"]

    async def _start(self) -> _Child:
        child = _Child(self._init, asyncio.get_running_loop())
        self._children.add(child)
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await asyncio.shield(child.ready)
        except (TimeoutError, RendererFailed) as e:
            self._discard(child)
            log.error(
                "%s",
                e
                if isinstance(e, RendererFailed)
                else f"the chat template renderer did not start within {START_TIMEOUT_S:g} s",
            )
            raise errors.Unavailable(
                "the chat template renderer could not start; retry shortly", retry_after_s=self.retry_after_s
            ) from None
        except BaseException:
            self._discard(child)
            raise
        return child

    def _discard(self, child: _Child) -> None:
        child.kill()
        self._children.discard(child)

    def close(self) -> None:
        """Ends every child (renders in flight fail)."""
        _kill_all(self._children)
        self._idle.clear()


def _kill_all(children: set) -> None:
    for child in list(children):
        child.kill()
    children.clear()


# ---- the child ----
def _serve(stdin, stdout) -> None:
    init = _read_frame(stdin)
    template = ChatTemplate(init["source"], init["special_tokens"], init["origin"])
    _write_frame(stdout, {"ready": True})
    while True:
        try:
            request = _read_frame(stdin)
        except EOFError:
            return
        try:
            reply = {"text": template.render(**request)}
        except InvalidRequestError as e:
            reply = {"field": e.field, "error": e.detail}
        except Exception:  # noqa: BLE001 -- whatever a hostile template makes fail; the request fails alone
            reply = {"field": "messages", "error": "the chat template failed to render"}
        _write_frame(stdout, reply)


def main() -> None:
    import resource

    try:
        resource.setrlimit(resource.RLIMIT_AS, (RENDER_MEMORY_BYTES, RENDER_MEMORY_BYTES))
    except (ValueError, OSError):  # a lower hard limit is already in force
        pass
    # Frames own the real stdout; anything else printing goes to stderr.
    stdout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _serve(sys.stdin.buffer, stdout)


if __name__ == "__main__":
    main()
