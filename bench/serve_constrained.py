"""Constrained-decoding serving benchmark: N concurrent clients (16) asking a JSON-schema-constrained completion
against the same clients unconstrained, through one worker and one router, in the same run.

A grammar ends a reply when it completes (ignore_eos cannot apply), so the two sides are matched on the tokens
actually generated: a warm-up round of constrained requests (greedy: the same prompts give the same replies)
fixes each client's length, and the unconstrained request of that client generates exactly that many tokens
(ignore_eos, min = max). The schema (`output_schema`) has bounded fields and an array of k words, k = G / 4
(--new-tokens G), so every reply is long, and it completes within max_new_tokens (its longest text in bytes:
one token is at least one byte). Each constrained reply must parse as JSON (and validate, with jsonschema
installed): one that does not fails the run.

Per round: decode tok/s = tokens after each client's first / (the round's last token - its first first token);
TTFT: request start to first token. After the warm-up the rounds alternate (C P P C ...), so a drift in the
machine's load cancels out; the numbers are medians over rounds. Target on an H200 at 16 clients: decode
throughput constrained / unconstrained >= 0.85.

Models without a tokenizer.json (bench/engine.py's built cuda shapes) get the default model's (a 4,096-id BPE;
the masks still span the model's whole vocabulary): the router needs one to compile grammars.
    python bench/serve.py --workload constrained --backend cpu | --backend cuda --out out/serve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from bench.serve_clients import log, percentile
from bench.serve_services import (
    REPO,
    ROUTER_READY,
    WORKER_READY,
    Process,
    device_name,
    free_port,
    prepare_models,
    router_command,
    wait_serving,
    worker_command,
)
from common.pb import router_pb2 as rpb
from common.pb import router_pb2_grpc

DEFAULTS = {  # prompt tokens P, new tokens G, clients N, measured rounds
    "cpu": dict(prompt_tokens=32, new_tokens=16, clients=16, rounds=4),
    "cuda": dict(prompt_tokens=128, new_tokens=64, clients=16, rounds=4),
}
KV_BLOCK, MAX_BATCH_TOKENS = 16, 2048
TARGET = ("decode_tok_s_constrained_x_unconstrained", ">=", 0.85)  # on an H200, 16 clients
DEFAULT_TOKENIZER = REPO / "training" / "default-model-hf" / "tokenizer.json"
WORD = 8  # the longest word, in letters


def output_schema(new_tokens: int) -> tuple[dict, int]:
    """The schema and its longest reply in bytes (no free whitespace: the router compiles JSON without it)."""
    words = max(1, new_tokens // 4)
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "words": {
                "type": "array",
                "minItems": words,
                "maxItems": words,
                "items": {"type": "string", "pattern": f"^[a-z]{{3,{WORD}}}$"},
            },
        },
        "required": ["id", "kind", "words"],
        "additionalProperties": False,
    }
    longest = len('{"id":999,"kind":"gamma","words":[]}') + words * (WORD + 3)
    return schema, longest


async def _request(stub, prompt: list[int], parameters: rpb.SamplingParameters) -> dict:
    request = rpb.GenerateStreamRequest(token_ids=rpb.TokenIds(ids=prompt), parameters=parameters)
    start, times, ids = time.perf_counter(), [], []
    async for message in stub.GenerateStream(request, timeout=600):
        if message.token_ids:
            times.append(time.perf_counter())
            ids += message.token_ids
    return {"start": start, "times": times, "tokens": len(ids), "ids": ids}


def _round_summary(results: list[dict]) -> dict:
    first, last = min(r["times"][0] for r in results), max(r["times"][-1] for r in results)
    decode_tokens = sum(r["tokens"] - 1 for r in results)  # every message after the first holds one token
    return {
        "decode_tok_s": decode_tokens / max(last - first, 1e-9),
        "ttft_p50_ms": percentile([(r["times"][0] - r["start"]) * 1e3 for r in results], 50),
        "tokens": sum(r["tokens"] for r in results),
        "wall_s": last - min(r["start"] for r in results),
    }


def check_outputs(results: list[dict], schema: dict, tokenizer) -> None:
    """Every constrained reply parses as JSON (and validates, where jsonschema is installed). The reply's own
    ids are decoded: the streamed text of a random-id prompt can begin with its unfinished UTF-8 bytes."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    for i, r in enumerate(results):
        r["text"] = tokenizer.decode(r["ids"], skip_special_tokens=False)
        try:
            value = json.loads(r["text"])
        except ValueError as e:
            raise RuntimeError(f"constrained reply {i} does not parse as JSON ({e}): {r['text']!r}") from None
        if jsonschema is not None:
            try:
                jsonschema.validate(value, schema)
            except jsonschema.ValidationError as e:
                raise RuntimeError(f"constrained reply {i} breaks the schema ({e.message}): {r['text']!r}") from None


async def _workload(target: str, args, prompts: list[list[int]], tokenizer) -> dict:
    schema, longest = output_schema(args.new_tokens)
    constrained = rpb.SamplingParameters(
        max_new_tokens=longest, constraint=rpb.Constraint(json_schema=json.dumps(schema))
    )  # greedy; EOS is allowed where the grammar accepts (it stops there anyway)
    channels = [grpc.aio.insecure_channel(target) for _ in prompts]
    stubs = [router_pb2_grpc.GenerationServiceStub(c) for c in channels]

    async def run(kind: str, lengths: list[int]) -> list[dict]:
        def params(n: int) -> rpb.SamplingParameters:
            if kind == "constrained":
                return constrained
            return rpb.SamplingParameters(max_new_tokens=n, min_new_tokens=n, ignore_eos=True)

        return list(await asyncio.gather(*(_request(s, p, params(n)) for s, p, n in zip(stubs, prompts, lengths))))

    out: dict = {"constrained": [], "unconstrained": []}
    try:
        warm = await run("constrained", [0] * len(prompts))  # compiles the grammar; fixes each client's length
        check_outputs(warm, schema, tokenizer)
        lengths = [r["tokens"] for r in warm]
        await run("unconstrained", lengths)
        for r in range(args.rounds):  # C P, P C, C P, ...: a drift in the machine's load cancels out
            pair = ("constrained", "unconstrained")
            for kind in pair if r % 2 == 0 else pair[::-1]:
                results = await run(kind, lengths)
                if kind == "constrained":
                    check_outputs(results, schema, tokenizer)
                    got = [x["tokens"] for x in results]
                    if got != lengths:  # batch composition can move a greedy pick; the match is then looser
                        out["length_changes"] = out.get("length_changes", 0) + 1
                out[kind].append(_round_summary(results))
    finally:
        for c in channels:
            await c.close()
    out["lengths"] = lengths
    out["schema"] = schema
    out["max_new_tokens_constrained"] = longest
    out["sample_reply"] = warm[0]["text"]
    return out


def _median(rounds: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in rounds])) for k in rounds[0]} | {"rounds": rounds}


def measure(model_dir: Path, args, logs: Path, vocab: int) -> dict:
    _, longest = output_schema(args.new_tokens)
    per_request = -(-(args.prompt_tokens + longest) // KV_BLOCK) * KV_BLOCK
    cfg = dict(
        backend=args.backend,
        kv_block_size=KV_BLOCK,
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_batch_size=max(64, args.clients),
        kv_cache_tokens=2 * args.clients * per_request + MAX_BATCH_TOKENS,
        max_concurrent_requests=max(128, 2 * args.clients),
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, args.prompt_tokens).tolist() for _ in range(args.clients)]
    worker_port, port, token = free_port(), free_port(), secrets.token_urlsafe(32)
    worker = Process("worker", worker_command(model_dir, cfg, worker_port), logs / "worker.log", token)
    router = None
    try:
        wait_serving(f"127.0.0.1:{worker_port}", worker, args.start_timeout, WORKER_READY)
        cmd = router_command(model_dir, cfg, worker_port, port, free_port(), args.pipeline_depth)
        router = Process("router", cmd, logs / "router.log", token)
        wait_serving(f"127.0.0.1:{port}", router, 120, ROUTER_READY)
        log(f"  {args.clients} clients, constrained and unconstrained")
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        measured = asyncio.run(_workload(f"127.0.0.1:{port}", args, prompts, tokenizer))
        router.check()
        worker.check()
    finally:
        if router is not None:
            router.stop()
        worker.stop()
    out = {kind: _median(measured.pop(kind)) for kind in ("constrained", "unconstrained")}
    c, u = out["constrained"], out["unconstrained"]
    out["ratios"] = {
        TARGET[0]: c["decode_tok_s"] / u["decode_tok_s"],
        "ttft_p50_constrained_x_unconstrained": c["ttft_p50_ms"] / u["ttft_p50_ms"],
    }
    return out | measured | {"config": cfg}


def ensure_tokenizer(model_dir: Path) -> str:
    """The model's tokenizer.json, or the default model's copied in (the router compiles grammars with it)."""
    if (model_dir / "tokenizer.json").is_file():
        return "the model's"
    shutil.copy(DEFAULT_TOKENIZER, model_dir / "tokenizer.json")
    return "the default model's (4,096 ids), copied in"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shapes", default="mixtral-shape", help="cuda: bench/engine.py's shapes")
    parser.add_argument("--model", help="a converted model directory instead of the built ones")
    for name in DEFAULTS["cpu"]:
        parser.add_argument("--" + name.replace("_", "-"), type=int, help=f"default: cpu/cuda {name} above")
    parser.add_argument("--pipeline-depth", type=int, default=2, help="the router's (constrained requests: 1)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--name", help="file stem (default: <cpu|gpu>-serve-constrained)")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.backend].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.new_tokens < 4 or args.prompt_tokens < 1 or args.rounds < 1 or args.clients < 1:
        parser.error("need --new-tokens >= 4, --prompt-tokens >= 1, --rounds >= 1, --clients >= 1")
    device = device_name(args.backend)
    name = args.name or ("cpu" if args.backend == "cpu" else "gpu") + "-serve-constrained"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="colibri-constrained-bench-"))
    results = {"benchmark": "serve-constrained", "machine": platform.node(), "device": device}
    results |= {"cpu_count": os.cpu_count(), "load_average_start": list(os.getloadavg())}
    results |= {"config": {k: getattr(args, k) for k in (*DEFAULTS["cpu"], "pipeline_depth")}, "models": {}}
    results["target"] = {"key": TARGET[0], "op": TARGET[1], "value": TARGET[2], "clients": 16, "device": "H200"}
    path = out_dir / f"{name}.json"
    try:
        for model_name, model_dir in prepare_models(args, workdir):
            from common.model_format import ModelDir

            vocab = ModelDir.open(model_dir, verify=False).config.vocab_size
            tokenizer = ensure_tokenizer(Path(model_dir))
            logs = workdir / f"logs-{model_name}"
            logs.mkdir(parents=True, exist_ok=True)
            log(f"{model_name}: constrained against unconstrained (logs in {logs}; tokenizer: {tokenizer})")
            entry = measure(Path(model_dir), args, logs, vocab) | {"tokenizer": tokenizer}
            results["models"][model_name] = entry
            results["load_average_end"] = list(os.getloadavg())
            path.write_text(json.dumps(results, indent=1))
            c, u = entry["constrained"], entry["unconstrained"]
            print(f"\n{model_name} ({device}): {args.clients} clients, {np.mean(entry['lengths']):.1f} tokens a reply")
            print(f"  decode tok/s   constrained {c['decode_tok_s']:9.1f}   unconstrained {u['decode_tok_s']:9.1f}")
            print(f"  TTFT p50 ms    constrained {c['ttft_p50_ms']:9.1f}   unconstrained {u['ttft_p50_ms']:9.1f}")
            print(f"  {TARGET[0]}: {entry['ratios'][TARGET[0]]:.3f}   (target on the H200: {TARGET[1]} {TARGET[2]})")
    except BaseException:
        log(f"failed: the service logs are in {workdir}")
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    log(f"wrote {path}")
    return 0
