"""Where a step's host time goes, in wall-clock order: marks on entry and exit of the host's parts of a cuda step
(staging, graph replays, the per-expert GEMMs' host break and its stream synchronisation, the LM head, the
readback), without cProfile's per-call overhead, which inflates the Numba launches it is meant to measure.

A synchronisation that lasts is the host waiting for the device; a long stretch between marks with no wait in it
is host work the device may be idle behind (the last layer's GEMMs done, the head not yet launched, say).
bench/profile_step.py --host-timeline prints one step's marks per scenario beside its kernel totals.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


def _parts():
    """(owner, attribute) of every host part marked: import-time lookups, so a renamed method fails loudly."""
    from numba import cuda

    from expert_service.cuda.cublas import Cublas
    from expert_service.cuda.decoder import CudaDecoder
    from expert_service.cuda.driver import Graph
    from expert_service.cuda.model import CudaModel
    from expert_service.cuda.moe import DeviceMoe

    return [
        (CudaDecoder, "launch"),
        (CudaDecoder, "_stage"),
        (CudaDecoder, "_read_back"),
        (CudaDecoder, "finish"),
        (Graph, "replay"),
        (DeviceMoe, "_expert_gemms"),
        (DeviceMoe, "_gemm_group"),
        (Cublas, "linear_each"),
        (CudaModel, "head"),
        (type(cuda.default_stream()), "synchronize"),  # Numba's stream class (the simulator has its own)
    ]


@contextmanager
def marked(parts, marks: list):
    """Within the block, each (owner, name) in `parts` appends ("Owner.name >", t) and ("Owner.name <", t) to
    marks around every call (t: time.perf_counter()); the originals are restored after it."""
    originals = []
    for owner, name in parts:
        original = getattr(owner, name)
        label = f"{owner.__name__}.{name}"

        def wrapper(*args, _original=original, _label=label, **kwargs):
            marks.append((_label + " >", time.perf_counter()))
            try:
                return _original(*args, **kwargs)
            finally:
                marks.append((_label + " <", time.perf_counter()))

        originals.append((owner, name, original))
        setattr(owner, name, wrapper)
    try:
        yield marks
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def host_timeline(fn, sync, repeats: int = 3, parts=None) -> list[tuple[str, float]]:
    """fn() then sync(), `repeats` times with the host parts marked; the last run's marks as (label, us since its
    start), ending with ("end", us) after sync()."""
    marks: list = []
    runs = []
    with marked(parts if parts is not None else _parts(), marks):
        for _ in range(repeats):
            marks.clear()
            start = time.perf_counter()
            fn()
            sync()
            runs.append(
                [(label, (t - start) * 1e6) for label, t in marks] + [("end", (time.perf_counter() - start) * 1e6)]
            )
    return runs[-1]
