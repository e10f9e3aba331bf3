"""Bytes the router sends the worker for penalised requests that start on a cached prefix: the step messages as the
router builds and serialises them (Scheduler + router_service.wire, no worker, no sockets; answers are made up).

--sequences requests share a --prefix-tokens cached system prompt (computed by one request first), each adds a
--tail of its own and decodes --decodes tokens. Per penalty mode: the step that admits them (its size, and the
part that is PrefillChunk.prefix_token_ids) and the mean decode step. Modes: repetition penalty; presence/frequency
only to a worker with InfoResponse.prefix_tokens_for_repetition_only; the same to an older worker (the router then
sends the prefix tokens as it did before for every penalised request).

    python bench/prefix_tokens_wire.py --out out/prefix_tokens_wire.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BLOCK = 16
VOCAB = 151_936  # Qwen's: ids past 16383 take three bytes as varints


def _validated(prompt: list[int], repetition: float, presence: float, frequency: float):
    from router_service.validation import ValidatedRequest

    return ValidatedRequest(
        "", tuple(prompt), 1 << 20, 0, 0.0, 0, 1.0, 7, (), (), True, False,
        repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
    )  # fmt: skip


def _answers(step):
    from router_service.scheduler import RequestOutput

    out = [RequestOutput(c.request_id, 5 if c.is_last else None) for c in step.prefill_chunks]
    return out + [RequestOutput(rid, 5) for rid in step.decode_ids]


def measure(mode: str, sequences: int, prefix_tokens: int, tail: int, decodes: int) -> dict:
    from common.pb import worker_pb2 as pb
    from router_service import wire
    from router_service.prefix_cache import PrefixCache
    from router_service.scheduler import ScheduledRequest, Scheduler, SchedulerLimits
    from router_service.worker_info import sends_prefix_tokens

    rng = np.random.default_rng(0)
    info = pb.InfoResponse(prefix_tokens_for_repetition_only=mode != "presence-frequency, older worker")
    penalties = (1.2, 0.0, 0.0) if mode == "repetition" else (1.0, 0.5, 0.5)
    total = prefix_tokens + tail + decodes
    blocks = prefix_tokens // BLOCK + sequences * (-(-(total - prefix_tokens) // BLOCK) + 1) + 8
    limits = SchedulerLimits(sequences, max(2048, sequences * tail), BLOCK, blocks)
    scheduler = Scheduler(limits, PrefixCache(BLOCK, b"bench"))
    system = rng.integers(0, VOCAB, prefix_tokens).tolist()
    scheduler.add(ScheduledRequest(1, system, 1))  # computes the prefix, which the others start on
    while scheduler.requests:
        step = scheduler.schedule()
        scheduler.update(step, _answers(step))
    for rid in range(2, sequences + 2):
        prompt = system + rng.integers(0, VOCAB, tail).tolist()
        req = _validated(prompt, *penalties)
        scheduler.add(
            ScheduledRequest(
                rid,
                prompt,
                decodes,
                sampling=wire.sampling_params(req, [2]),
                penalized=True,
                sends_prefix_tokens=sends_prefix_tokens(req, info),
            )
        )
    sizes, prefix_bytes = [], []
    for step_id in range(decodes + 1):
        step = scheduler.schedule()
        message = wire.step_request(step, step_id)
        sizes.append(message.ByteSize())
        prefix_bytes.append(
            sum(pb.PrefillChunk(prefix_token_ids=c.prefix_token_ids).ByteSize() for c in message.chunks)
        )
        scheduler.update(step, _answers(step))
    assert not scheduler.requests, "every request was meant to finish"
    return {
        "admitting_step_bytes": sizes[0],
        "admitting_step_prefix_token_bytes": prefix_bytes[0],
        "decode_step_bytes_mean": float(np.mean(sizes[1:])),
        "decode_steps_prefix_token_bytes": int(sum(prefix_bytes[1:])),
        "all_steps_bytes": int(sum(sizes)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/prefix_tokens_wire.json")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=16384)
    parser.add_argument("--tail", type=int, default=32)
    parser.add_argument("--decodes", type=int, default=64)
    args = parser.parse_args(argv)
    modes = ("repetition", "presence-frequency", "presence-frequency, older worker")
    results = {m: measure(m, args.sequences, args.prefix_tokens, args.tail, args.decodes) for m in modes}
    print(f"{args.sequences} sequences x {args.prefix_tokens} cached prefix tokens, {args.decodes} decodes each")
    for mode, r in results.items():
        print(
            f"{mode:34s} admitting step {r['admitting_step_bytes']:>10,d} B "
            f"(prefix tokens {r['admitting_step_prefix_token_bytes']:>10,d} B), "
            f"decode step {r['decode_step_bytes_mean']:>6,.0f} B (prefix tokens {r['decode_steps_prefix_token_bytes']} B)"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"unit": "serialised bytes of StepStreamRequest", "args": vars(args), **results}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
