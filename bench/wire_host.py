"""Host time of one decode step's trip through both services' wire and step code, no GPU and no sockets: the
router's Scheduler.schedule, the step message built, serialised and parsed, the worker's StreamSession launch and
collect over an Engine whose decoder is a stub returning fixed greedy ids, the answer built, serialised and
parsed, and Scheduler.update. Every stage runs once per token in the served path, on top of the device step (the
router and the worker run theirs in separate processes, so a pipelined step is bound by the larger side).

Per batch size b: the median over --steps decode steps of each side's total and of each stage, in microseconds.
Run it in a checkout of each commit to compare (the figures depend on the host CPU):

    python bench/wire_host.py --out out/wire_host.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.engine_host import GreedyRows, write_results  # noqa: E402

BATCHES = (1, 16, 64)
CONTEXT = 32


def measure(steps: int, warmup: int) -> dict:
    from common.model_format import ModelDir
    from common.pb import worker_pb2 as pb
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.serving import wire as worker_wire
    from expert_service.serving.step_stream import StepLimits, StreamSession
    from expert_service.tools.tiny_model import make_tiny
    from router_service import wire as router_wire
    from router_service.scheduler import ScheduledRequest, Scheduler, SchedulerLimits

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = ModelDir.open(make_tiny(Path(tmp) / "m", family="mixtral", seed=1))
        for b in BATCHES:
            engine = build_engine(
                model,
                EngineConfig(backend="cpu", kv_block_size=16, max_batch_size=64, kv_cache_tokens=64 * 4096),
            )
            session = StreamSession(engine, {})
            limits = StepLimits.of(engine)
            scheduler = Scheduler(SchedulerLimits(64, 2048, 16, engine.allocator.num_blocks))
            rng = np.random.default_rng(0)
            sampling = pb.SamplingParams(top_p=1.0)
            for rid in range(b):
                prompt = rng.integers(3, 200, CONTEXT).tolist()
                scheduler.add(ScheduledRequest(rid + 1, prompt, steps + warmup + 4, sampling=sampling))
            stages: dict[str, list[float]] = {}

            def timed(name, fn, *args):
                start = time.perf_counter()
                value = fn(*args)
                stages.setdefault(name, []).append(time.perf_counter() - start)
                return value

            for n in range(warmup + steps + 1):
                if n == 1:  # the prompts ran for real; decodes get the stub's greedy ids
                    greedy = rng.integers(3, 200, 64)
                    engine.decoder.forward = lambda batch, trace=None: GreedyRows(greedy[: len(batch.logits_rows)])
                if n == warmup + 1:
                    stages.clear()
                step = timed("router.schedule", scheduler.schedule)
                data = timed("router.encode", lambda: router_wire.step_request(step, n).SerializeToString())
                request = timed(
                    "worker.decode", lambda: worker_wire.step_request(pb.StepStreamRequest.FromString(data), limits)
                )
                answer = timed("worker.step", lambda: session.collect(session.launch(request)))
                reply = timed(
                    "worker.encode",
                    lambda: worker_wire.stream_response(answer.result, n, 0, 0.0).SerializeToString(),
                )
                outputs = timed(
                    "router.decode", lambda: router_wire.request_outputs(pb.StepStreamResponse.FromString(reply))
                )
                timed("router.update", scheduler.update, step, outputs)
            median = {name: float(np.median(values)) * 1e6 for name, values in stages.items()}
            median["router.total"] = sum(v for k, v in median.items() if k.startswith("router."))
            median["worker.total"] = sum(
                v for k, v in median.items() if k.startswith("worker.") and k != "worker.total"
            )
            results[f"b{b}"] = median
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/wire_host.json")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args(argv)
    results = measure(args.steps, args.warmup)
    names = list(next(iter(results.values())))
    print("us per decode step " + "".join(f"{b:>10s}" for b in results))
    for name in names:
        print(f"{name:18s} " + "".join(f"{results[b][name]:10.1f}" for b in results))
    write_results(Path(args.out), args.steps, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
