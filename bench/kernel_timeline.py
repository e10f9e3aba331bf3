"""The device's kernels while a step runs, recorded with CUPTI through torch.profiler (it sees every kernel of
the process, Numba's and cuBLAS's, including those replayed from CUDA graphs), for the benches that need more
than a total: `kernel_totals` (time and launches a step per kernel, bench/profile_step.py) and `step_timeline`
(one step's kernels in order with their streams, and where the stream that ends the step waited:
bench/offload.py --timeline).

A timeline answers what a total cannot: whether a stream's kernels ran beside another's or behind them. The
step's critical stream is the one whose last kernel ends last; its gaps are the time it spent waiting (for
another stream's event, or for the host's launches), each named by the kernel that ended it.
"""

from __future__ import annotations

import collections
import re
import time

GAP_US = 2.0  # gaps shorter than this are launch spacing inside a graph, not waiting


def short_name(name: str) -> str:
    """Numba's Itanium-mangled kernel names (_ZN<len><module>...<len><function>B...) -> the function name;
    other names (cuBLAS) cut to 60 characters."""
    if not name.startswith("_ZN"):
        return name[:60]
    parts, i = [], 3
    while i < len(name) and name[i].isdigit():
        digits = re.match(r"\d+", name[i:]).group()  # type: ignore[union-attr]
        i += len(digits)
        parts.append(name[i : i + int(digits)])
        i += int(digits)
    return parts[-1] if parts else name[:60]


def device_events(fn, repeats: int) -> tuple[list[tuple[str, int, float, float]], float]:
    """fn() once unrecorded, then `repeats` recorded calls (the device synchronised after them): every device
    event as (kernel name, stream, start us, duration us), in start order, and the host's wall us a call."""
    import torch
    from torch.profiler import ProfilerActivity

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / repeats
    rows = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            stream = getattr(event, "device_resource_id", None)
            stream = event.thread if stream is None else stream
            span = event.time_range
            rows.append((short_name(event.name), int(stream), float(span.start), float(span.end - span.start)))
    rows.sort(key=lambda row: row[2])
    return rows, wall * 1e6


def kernel_totals(fn, repeats: int) -> tuple[dict[str, list], float]:
    """Per kernel name [us, launches] a call, and the host's wall us a call (`device_events`)."""
    rows, wall_us = device_events(fn, repeats)
    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for name, _, _, duration in rows:
        entry = totals[name]
        entry[0] += duration / repeats
        entry[1] += 1 / repeats
    return dict(totals), wall_us


def step_timeline(fn) -> dict:
    """One call of fn (after an unrecorded one) as a timeline (`timeline_of`)."""
    rows, wall_us = device_events(fn, 1)
    return timeline_of(rows, wall_us)


def timeline_of(rows: list[tuple[str, int, float, float]], wall_us: float) -> dict:
    """Device events (`device_events`, start order) as a timeline: per stream its busy us, kernel count and busy
    us by kernel name ([us, launches], largest first: what a stream spent its time on), the critical stream's
    waits (gaps over GAP_US, each with the kernel that ended it), and every kernel as [name, stream, start us
    from the first kernel, duration us]."""
    if not rows:
        return {"wall_us": wall_us, "span_us": 0.0, "streams": {}, "waited_us": 0.0, "waits": [], "kernels": []}
    origin = rows[0][2]
    end_of: dict[int, float] = {}
    by_name: dict[int, dict[str, list]] = {}  # stream -> kernel name -> [us, launches], in first-seen order
    for name, stream, start, duration in rows:
        entry = by_name.setdefault(stream, {}).setdefault(name, [0.0, 0])
        entry[0] += duration
        entry[1] += 1
        end_of[stream] = max(end_of.get(stream, start), start + duration)
    critical = max(end_of, key=lambda s: end_of[s])
    waits: list[dict] = []
    last_end = None
    for name, stream, start, duration in rows:
        if stream != critical:
            continue
        if last_end is not None and start - last_end > GAP_US:
            waits.append({"at_us": round(last_end - origin, 2), "us": round(start - last_end, 2), "before": name})
        last_end = start + duration if last_end is None else max(last_end, start + duration)
    return {
        "wall_us": wall_us,
        "span_us": max(end_of.values()) - origin,
        "critical_stream": critical,
        "streams": {
            str(s): {
                "busy_us": round(sum(us for us, _ in names.values()), 2),
                "kernels": sum(n for _, n in names.values()),
                "by_name": {
                    name: [round(us, 2), n] for name, (us, n) in sorted(names.items(), key=lambda item: -item[1][0])
                },
            }
            for s, names in by_name.items()
        },
        "waited_us": round(sum(w["us"] for w in waits), 2),
        "waits": waits,
        "kernels": [[n, s, round(t - origin, 2), round(d, 2)] for n, s, t, d in rows],
    }
