"""Where a served step's time goes between the two services: runs a serving benchmark (bench/serve.py by default,
any arguments after `--` passed on) with bench/hops/sitecustomize.py stamping the entry (`>`) and exit (`<`) of the
functions each hop starts or ends with, in the router and the worker it starts, then prints the median time of each
transition between consecutive stamps (all processes merged on the one monotonic clock) and the worker's
launch-to-launch period (--timeline: every stamp, the launches labelled p<prompt tokens>d<decodes>). What the stamps
are:

  W_parse   the worker reads a step message (wire.step_request)      R_apply  the router applies an answer
  W_launch  the model thread launches a step (StreamSession.launch)  R_send   the router builds and sends a step
  W_collect the model thread collects a step                         R_write  its gRPC write (StepStream.send)
  W_answer  the worker's event loop answers a step                   R_masks  grammar masks computed (masks_of)
                                                                     R_submit a request through the front (Frontend.submit)
                                                                     R_admit  its admission (BatchingLoop.submit)
                                                                     R_stream a GenerateStream call's handler
  W_late_masks  late grammar masks applied (Engine.apply_late_masks), within it (cuda) W_device_masks (their
                upload, mask and argmax launches: DeviceMasks.apply) and W_read_back (CudaDecoder._read_back)
  GC2       a garbage collection of the oldest generation, in any of the processes (the bench's clients too):
            the process stops while it scans every tracked object

Read it as a chain: e.g. `W_answer< -> R_apply>` is the answer's trip from the worker's event loop through gRPC
into the router's batching loop. With several steps in flight the chain interleaves; transitions seen fewer than
--min-count times are left out. JSON to --out.

    python bench/serve_hops.py --out out/hops.json -- --backend cpu --clients 1 --depths 1
    python bench/serve_hops.py --out out/hops.json -- --workload constrained --backend cuda
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def read_stamps(folder: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str, str]]]:
    """(monotonic ns, stamp) sorted, and the same with each stamp's label and its process id (the timeline)."""
    timeline = []
    for path in folder.glob("hops.*"):
        for line in path.read_text().splitlines():
            name, t, *label = line.split()
            timeline.append((int(t), name, " ".join([path.suffix[1:], *label])))
    timeline.sort()
    return [(t, name) for t, name, _ in timeline], timeline


def summarize(events: list[tuple[int, str]], min_count: int) -> dict:
    """Median microseconds of each transition between consecutive stamps, and the worker's launch period."""
    gaps = collections.defaultdict(list)
    for (t0, a), (t1, b) in zip(events, events[1:]):
        gaps[f"{a} -> {b}"].append((t1 - t0) / 1e3)
    launches = np.diff([t for t, name in events if name == "W_launch>"]) / 1e3
    rows = {
        k: {"count": len(v), "p50_us": float(np.median(v)), "mean_us": float(np.mean(v))}
        for k, v in sorted(gaps.items(), key=lambda kv: -len(kv[1]))
        if len(v) >= min_count
    }
    period = {"count": int(launches.size), "p50_us": float(np.median(launches))} if launches.size else None
    return {"transitions": rows, "worker_launch_period": period}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, theirs = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/hops.json")
    parser.add_argument("--bench", default=str(REPO / "bench" / "serve.py"), help="the benchmark script to run")
    parser.add_argument("--min-count", type=int, default=20)
    parser.add_argument("--timeline", help="also write every stamp (ns, name, 'pid label') to this JSON file")
    args = parser.parse_args(ours)
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, COLIBRI_HOPS=str(Path(tmp) / "hops"))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "bench" / "hops"), env.get("PYTHONPATH")) if p)
        bench_out = Path(tmp) / "bench"
        code = subprocess.call([sys.executable, args.bench, *theirs, "--out", str(bench_out)], env=env, cwd=REPO)
        if code:
            print(f"{args.bench} exited with {code}", file=sys.stderr)
            return code
        events, timeline = read_stamps(Path(tmp))
    if not events:
        print("no stamps were written: did the services start from this checkout?", file=sys.stderr)
        return 1
    result = {"command": theirs, **summarize(events, args.min_count)}
    print(f"\n{'transition':44s} {'count':>6s} {'p50 us':>9s} {'mean us':>9s}")
    for name, row in result["transitions"].items():
        print(f"{name:44s} {row['count']:6d} {row['p50_us']:9.1f} {row['mean_us']:9.1f}")
    if result["worker_launch_period"]:
        period = result["worker_launch_period"]
        print(f"worker launch-to-launch period: p50 {period['p50_us']:.1f} us over {period['count']} steps")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.timeline:
        Path(args.timeline).write_text(json.dumps(timeline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
