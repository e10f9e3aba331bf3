"""Hop stamps for bench/serve_hops.py: imported at start-up by every Python process whose PYTHONPATH starts with this
folder (the bench puts it there for the router and worker it starts). With COLIBRI_HOPS=<prefix> set, it wraps a
few functions of both services as their modules load and appends `name monotonic_ns [label]` lines to <prefix>.<pid>:
entry (`>`) and exit (`<`) of each. Nothing in the services knows about it; without the variable it does nothing."""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.util
import inspect
import os
import sys
import time

PREFIX = os.environ.get("COLIBRI_HOPS")
# module -> (attribute path, stamp name): what each hop's ends are
TARGETS = {
    "expert_service.serving.wire": [("step_request", "W_parse")],
    "expert_service.serving.step_stream": [
        ("StreamSession.launch", "W_launch"),
        ("StreamSession.collect", "W_collect"),
    ],
    "expert_service.serving.servicer": [("WorkerServicer._stream_response", "W_answer")],
    "expert_service.engine.engine": [("Engine.apply_late_masks", "W_late_masks")],
    "expert_service.cuda.token_masks": [("DeviceMasks.apply", "W_device_masks")],
    "expert_service.cuda.decoder": [("CudaDecoder._read_back", "W_read_back")],
    "router_service.batching_loop": [("BatchingLoop._send", "R_send"), ("BatchingLoop.submit", "R_admit")],
    "router_service.step_pipeline": [("masks_of", "R_masks")],
    "router_service.step_results": [("StepResults.apply", "R_apply")],
    "router_service.frontend": [("Frontend.submit", "R_submit")],
    "router_service.servicer": [("GenerationServicer.GenerateStream", "R_stream")],
    "router_service.worker_client": [("StepStream.send", "R_write")],
}
# stamp name -> what its entry stamp also records (the launch: prompt tokens and decodes of the step)
LABELS = {
    "W_launch": lambda session, step, *a, **k: f"p{sum(len(c.token_ids) for c in step.chunks)}d{len(step.decode_ids)}",
}
_lines: list[str] = []


def _flush() -> None:
    n = len(_lines)  # a collection's stamp can arrive while these are written: it stays for the next flush
    if n:
        with open(f"{PREFIX}.{os.getpid()}", "a") as f:
            f.write("".join(_lines[:n]))
        del _lines[:n]


def _stamp(name: str, label: str = "") -> None:
    _lines.append(f"{name} {time.monotonic_ns()} {label}\n")
    if len(_lines) >= 512:
        _flush()


def _wrap(fn, name: str):
    label = LABELS.get(name, lambda *a, **k: "")

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def wrapped_async(*args, **kwargs):
            _stamp(name + ">", label(*args, **kwargs))
            try:
                return await fn(*args, **kwargs)
            finally:
                _stamp(name + "<")

        return wrapped_async

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        _stamp(name + ">", label(*args, **kwargs))
        try:
            return fn(*args, **kwargs)
        finally:
            _stamp(name + "<")

    return wrapped


def _patch(module) -> None:
    for path, name in TARGETS[module.__name__]:
        owner, *rest = path.split(".")
        if rest:
            cls = getattr(module, owner)
            setattr(cls, rest[0], _wrap(getattr(cls, rest[0]), name))
        else:
            setattr(module, owner, _wrap(getattr(module, owner), name))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _gc_stamp(phase: str, info: dict) -> None:
    """Garbage collections of the oldest generation, which stop the process for as long as they scan (`GC2`)."""
    if info.get("generation") == 2:
        _stamp("GC2>" if phase == "start" else "GC2<", str(info.get("collected", "")) if phase == "stop" else "")


if PREFIX:
    import gc

    sys.meta_path.insert(0, _Finder())
    gc.callbacks.append(_gc_stamp)
    atexit.register(_flush)
