"""Offload benchmark: Colibri's expert cache against HF transformers with accelerate CPU
offload at the same device budget, same weights, one run.

For each reference shape (bench/engine.py SHAPES) it builds the random bf16 model with transformers, writes it
as a Colibri model directory (to --workdir, /dev/shm by default) and runs Colibri with the expert cache holding
100%, 50%, 25% and 12.5% of the expert bytes (slots per MoE layer = max(1, round(fraction x num_experts)))
under each prefetch mode: none, plan (the static routing table), lookahead (layer L+1's gate on layer L's
input) and plan+lookahead. At 100% every expert is resident, no cache logic runs, and there is one run.

Measured per run: prefill tok/s (b=1 x 512, best of 3), decode tok/s at b=1 and b=16 (context 128, median of
16 steps after 3 warm-up steps; greedy continuations, then new prompts whose continuations are sampled at
--temperature, 0.8 unless set, with fixed seeds: greedy loops revisit the same experts and inflate hit rates),
and the expert-cache counts summed over the timed steps: hit rate, bytes
copied per token (demand + prefetch copies), prefetches issued/used, stall fraction (stall time / step wall
time) and the PCIe bound: bytes copied per step / pinned host->device bandwidth, measured in the same run
(numba pinned_array -> device copy); x_pcie_bound = measured step time / bound (target at 25%: <= 1.5).

The "plan" prefetch needs a routing table: one is built for the benchmark model by tracing exact routing
(a fully resident engine, routing_gen.generate) over 64 x 128 random token ids; every step's plan is then
looked up from it the way the router does (prompt chunks first, then decode tokens). A table from random
weights and tokens says little about a trained model's on real traffic; its held-out recall and the per-step
plan recall are recorded next to the runs. `--plan-top-k 1,2` runs every plan mode once per k with the table's
k most likely predictions a token (keyed MODE/topK below the table's own k), `--plan-min-share 0.3,0.5` once per
F with the table gated by share (keyed MODE/shareF; it reads router-gen --save-counts' file; bench/offload_plan.py).

HF reference: the same weights, held on the host; at 100% the model is moved to the GPU; below it, the most
favourable placement at the same device budget (non-expert bytes + the Colibri run's slot bytes): everything
but the MoE blocks on GPU 0, then whole MoE blocks on the GPU while they fit and the rest mapped to the CPU,
dispatched with accelerate's dispatch_model (its hooks copy the CPU-mapped blocks to the GPU at every
forward). accelerate's own infer_auto_device_map keeps a whole decoder layer of headroom and would place
fewer weights than the budget. Prefill and decode are timed as bench/engine.py's bench_hf does, with fewer
decode steps when offloaded (each takes ~a second); a failing reference is recorded as an error.
Needs `accelerate` (not a project dependency).
    python bench/offload.py --out out/ [--shapes mixtral-shape,qwen3moe-shape] [--fractions 1,0.5,0.25,0.125]
        [--prefetch-modes none,plan,lookahead,plan+lookahead] [--backend cuda] [--skip-hf] [--workdir /dev/shm/...]
        [--plan-source worker|router] [--plan-top-k 1,2] [--plan-min-share 0.3,0.5] [--policy lru|lfu]
        [--temperature 0.8] [--timeline]
        [--cached-gemv on,off] [--pipelined-waves on,off] [--cached-mma on,off] [--cached-mma-large on,off]
        [--prefetch-yields on,off]

`--cached-gemv on,off` / `--pipelined-waves on,off` / `--cached-mma on,off` / `--cached-mma-large on,off` /
`--prefetch-yields on,off` run every
cached (fraction, mode) with and without that CudaOptions field (docs/expert-cache.md) and print the step times
(decode at each batch size, and the prefill step) side by side with their ratio. `--timeline` records one more
decode step of every run kernel by kernel (bench/kernel_timeline.py: each stream's busy time, where the stream that
ends the step waited and on what) into the JSON, beside the step's figures.

`--shapes tiny --backend cpu`: expert_service.tools.tiny_model's Mixtral, no HF (tests/bench/test_offload.py; counts only).
A trained model instead of the random shapes (bench/offload_model.py says why each input matters):

    python bench/offload.py --model DIR --prompts heldout.txt [--table DIR/routing_table.bin]
        [--hf-model HF_DIR | --skip-hf] [--decode-steps N] --out out/

DIR is a converted Colibri model directory; prompts are slices of the --prompts text (held out from training
and from the table's corpus), the plan prefetch uses the `colibri router-gen` table, and HF loads the
checkpoint DIR was converted from. `--prompts` also works with `--shapes tiny` (its byte tokenizer).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import SHAPES, build_hf, pipelined_decode, write_colibri  # noqa: E402
from bench.kernel_timeline import step_timeline  # noqa: E402
from bench.offload_hf import (  # noqa: E402
    DECODE_BATCHES,
    DECODE_CONTEXT,
    DECODE_STEPS,
    PREFILL_TOKENS,
    bench_hf_budgets,
)
from bench.offload_model import TokenSource, load_table, open_model, text_source  # noqa: E402
from bench.offload_plan import (  # noqa: E402
    build_routing_table,
    check_plan_cuts,
    cut_fields,
    own_cut,
    parse_plan_min_share,
    parse_plan_top_k,
    plan_runs,
    plan_tables,
)
from bench.offload_report import (  # noqa: E402
    DECODE_PHASES,
    OPTIONS,
    option_key,
    plot_offload,
    print_offload,
    print_option,
    print_run,
)
from common.errors import ColibriError  # noqa: E402
from common.model_format import ModelDir  # noqa: E402
from common.routing_table import RoutingTable  # noqa: E402
from expert_service.backends import build_engine, cuda_available
from expert_service.engine.config import EngineConfig  # noqa: E402
from expert_service.engine.cuda_options import CudaOptions  # noqa: E402
from expert_service.engine.engine import Engine, PrefillInput  # noqa: E402
from expert_service.engine.sampling import SamplingParams  # noqa: E402
from expert_service.experts.cache import POLICIES, CacheStats  # noqa: E402
from expert_service.experts.slots import plan_slots  # noqa: E402

FRACTIONS = (1.0, 0.5, 0.25, 0.125)
PREFETCH_MODES = ("none", "plan", "lookahead", "plan+lookahead")
TINY = "tiny"  # test-only shape: expert_service.tools.tiny_model's Mixtral (cpu backend, no HF)
NOMINAL_PCIE_BYTES_PER_S = 55e9  # pinned host->device on the H200; used only when no GPU can measure it
PREFILL_REPEATS, WARMUP_STEPS = 3, 3
SAMPLED_TEMPERATURE = 0.8  # the sampled continuations' temperature unless --temperature says otherwise


def measure_pcie(nbytes: int = 512 << 20, repeats: int = 5) -> float | None:
    """Pinned host -> device bytes/s, best of `repeats` copies of `nbytes` on one stream; None without a GPU."""
    if not cuda_available():
        return None
    from numba import cuda

    host = cuda.pinned_array(nbytes, dtype=np.uint8)
    device = cuda.device_array(nbytes, dtype=np.uint8)
    stream = cuda.stream()
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy warms up
        start = time.perf_counter()
        device.copy_to_device(host, stream=stream)
        stream.synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def make_engine(
    model: ModelDir,
    backend: str,
    slots: int = 0,
    prefetch: str = "none",
    options: CudaOptions = CudaOptions(),
    plan_table: str = "router",
    policy: str = "lru",
) -> Engine:
    return build_engine(
        model,
        EngineConfig(
            backend=backend,
            kv_block_size=16,
            kv_cache_tokens=8192,
            max_batch_tokens=2048,
            max_batch_size=16,
            expert_cache_slots=slots,
            prefetch=prefetch.replace("+", ","),
            cuda_options=options,
            plan_table=plan_table,
            expert_cache_policy=policy,
        ),
    )


def close(engine: Engine) -> None:
    decoder = engine.decoder
    closer = getattr(decoder, "close", None) or getattr(getattr(decoder, "copy_engine", None), "close", None)
    if closer is not None:
        closer()


def cache_stats(result) -> CacheStats:
    """The step's expert-cache counts; with every expert resident, each distinct expert per layer is a hit."""
    if result.expert_cache is not None:
        return result.expert_cache
    return CacheStats(hits=sum(len(np.unique(ids)) for ids in result.trace.expert_ids.values()))


def summarize(runs: list, tokens_per_step: int, bytes_per_s: float, pick=np.median) -> dict:
    """runs: [(seconds, StepResult)] of one phase -> tok/s, cache counts and the PCIe bound."""
    times = [t for t, _ in runs]
    stats = sum((cache_stats(r) for _, r in runs), CacheStats())
    step_s = float(pick(times))
    bound_s = stats.bytes_copied / len(runs) / bytes_per_s
    recalls = [r.routing_plan_recall for _, r in runs if r.routing_plan_recall is not None]
    return {
        "tok_s": tokens_per_step / step_s,
        "ms_per_step": step_s * 1e3,
        "steps": len(runs),
        **asdict(stats),
        "hit_rate": stats.hit_rate,
        "bytes_copied_per_token": stats.bytes_copied / (tokens_per_step * len(runs)),
        "stall_fraction": stats.stall_seconds / sum(times),
        "pcie_bound_ms": bound_s * 1e3,
        "x_pcie_bound": step_s / bound_s if bound_s else None,
        "plan_recall": float(np.mean(recalls)) if recalls else None,
    }


def bench_colibri(
    engine: Engine,
    table: RoutingTable | None,
    bytes_per_s: float,
    tokens: TokenSource,
    decode_steps: int = DECODE_STEPS,
    timeline: bool = False,
    temperature: float = 0.0,
) -> dict:
    """Prefill b=1 x 512, then decode at each batch size; the step's routing plan goes along when prefetching
    from the plan (looked up outside the timed region: the router does it before sending the step). Prompts
    come from `tokens`, the same ones for every engine. timeline (cuda): one more decode step per batch size
    recorded kernel by kernel (bench/kernel_timeline.py), to see which stream a step waited on.
    temperature > 0: the decode phases run again on new prompts whose continuations are sampled at that
    temperature (seed = the request id, so every engine samples the same way), into "decode_sampled": greedy
    continuations of a random or briefly trained model fall into loops that revisit the same experts and
    inflate hit rates."""
    take = tokens.sampler()
    thread = _model_thread(engine)
    use_plan = table is not None and "plan" in engine.config.prefetch_sources
    sync = getattr(getattr(engine.decoder, "stream", None), "synchronize", lambda: None)

    def chunk(rid: int, n: int, sampling: SamplingParams = SamplingParams()) -> PrefillInput:
        return PrefillInput(rid, take(n), sampling, True)

    def step(prefill=(), decode_ids=()):
        routing_plan = None
        if use_plan:  # the worker's token order: prompt chunks, then one token per decoding sequence
            last = np.array([engine.sequences[rid].last_token for rid in decode_ids], dtype=np.int64)
            routing_plan = table.routing_plan(np.concatenate([c.token_ids for c in prefill] + [last]))
        start = time.perf_counter()
        result = engine.step(list(prefill), list(decode_ids), routing_plan)
        sync()
        return time.perf_counter() - start, result

    runs = []
    for i in range(1 + PREFILL_REPEATS):  # the first one warms up
        runs.append(step([chunk(1000 + i, PREFILL_TOKENS)]))
        engine.clear()
    out = {
        "memory_plan": dict(engine.decoder.memory_plan()),
        "prefill": summarize(runs[1:], PREFILL_TOKENS, bytes_per_s, pick=min),
    }
    phases = [("decode", lambda rid: SamplingParams())]
    if temperature > 0:
        out["sampled_temperature"] = temperature
        phases.append(("decode_sampled", lambda rid: SamplingParams(temperature=temperature, seed=rid)))
    for phase, sampling in phases:
        out[phase] = {}
        for b in DECODE_BATCHES:
            ids = list(range(b))
            step([chunk(rid, DECODE_CONTEXT, sampling(rid)) for rid in ids])  # b x 128 <= max_batch_tokens
            for _ in range(WARMUP_STEPS):  # cuda: eager, capture, replay
                step(decode_ids=ids)
            runs = [step(decode_ids=ids) for _ in range(decode_steps)]
            out[phase][str(b)] = summarize(runs, b, bytes_per_s)
            if timeline and thread is not None and phase == "decode":
                out[phase][str(b)]["timeline"] = step_timeline(lambda: step(decode_ids=ids))
            if thread is not None and not use_plan:  # as bench/engine.py serves: graphs, two steps in flight
                seconds, _ = pipelined_decode(engine, ids, thread, lambda result, context: 0)
                out[phase][str(b)]["pipelined_tok_s"] = b / seconds
            engine.clear()
    return out


_THREADS: dict = {}


def _model_thread(engine: Engine):
    """The model thread pipelined decode runs on (cuda only; one per process)."""
    if engine.decoder.backend.value != "cuda":
        return None
    if "thread" not in _THREADS:
        from expert_service.serving.lifecycle import ModelThread

        _THREADS["thread"] = ModelThread("bench-offload")
    return _THREADS["thread"]


def bench_shape(model: ModelDir, args, bytes_per_s: float, workdir: Path, tokens: TokenSource, saved=None) -> dict:
    """Every (fraction, prefetch mode) run of one model; without --table the resident engine also traces the
    routing table."""
    cfg = model.config
    plan = plan_slots(model, 0, 0)
    block, layers, experts = plan.expert_block_bytes, plan.num_moe_layers, plan.num_experts
    expert_bytes = block * experts * layers
    entry = {
        "num_experts": experts,
        "num_moe_layers": layers,
        "top_k": cfg.num_experts_per_tok,
        "expert_block_bytes": block,
        "expert_bytes": expert_bytes,
        "non_expert_bytes": model.total_bytes - expert_bytes,
        "prompts": tokens.describe(),
        "routing_table": None,
        "runs": {},
    }
    slots = {fraction: max(1, round(fraction * experts)) for fraction in args.fractions}
    table, table_path = None, args.table
    engine = make_engine(model, args.backend)  # every expert resident; closed before any cached engine
    try:  # is built (each pins the model's host pages)
        if args.table is not None:
            table, entry["routing_table"] = load_table(model, args.table)
        elif any("plan" in m for m in args.prefetch_modes):
            table_path = workdir / "routing_table.bin"
            table, entry["routing_table"] = build_routing_table(model, engine, table_path)
        cuts = (args.plan_top_k, workdir, args.plan_min_share)
        tables = plan_tables(model, table, table_path, *cuts) if table is not None else {}
        # every cached run is compared with the resident engine, measured in the same run
        resident = {
            "slots_per_layer": experts,
            "slot_bytes": expert_bytes,
            "prefetch": "n/a",
            **bench_colibri(engine, None, bytes_per_s, tokens, args.decode_steps, args.timeline, args.temperature),
        }
    finally:
        close(engine)
    entry["resident"] = resident
    saved = saved or (lambda entry: None)  # called after every run: a call cut off by its time limit keeps them
    saved(entry)
    entry["plan_cuts"] = list(tables)  # the tables the plan runs prefetch from: topK (first k), shareF (gated)
    for fraction, n in slots.items():
        runs = entry["runs"][str(fraction)] = {}
        if n >= experts:
            runs["resident"] = resident
            continue
        for mode, name, cut in plan_runs(args.prefetch_modes, tables, own_cut(table) if table is not None else None):
            run_table, run_path = tables[cut] if cut is not None else (table, table_path)
            for values in itertools.product(*(getattr(args, option) for option in OPTIONS)):
                settings = dict(zip(OPTIONS, values))
                key = option_key(name, settings)  # runs off the default options keyed apart
                # the worker's own lookup of the table (no plan sent with the steps, which then run two in flight
                # as served), or the router's plan sent with every step (--plan-source router)
                own = "plan" in mode and run_path is not None and args.plan_source == "worker"
                plan_table = str(run_path) if own else "router"
                cached = make_engine(model, args.backend, n, mode, CudaOptions(**settings), plan_table, args.policy)
                try:
                    runs[key] = {
                        "slots_per_layer": n,
                        "slot_bytes": n * layers * block,
                        "prefetch": mode,
                        "plan_source": ("worker" if own else "router") if "plan" in mode else None,
                        **cut_fields(cut, run_table, tokens.stream),
                        "policy": args.policy,
                        **settings,
                        **bench_colibri(
                            cached,
                            None if own else run_table,
                            bytes_per_s,
                            tokens,
                            args.decode_steps,
                            args.timeline,
                            args.temperature,
                        ),
                    }
                finally:
                    close(cached)
                saved(entry)
                for phase in DECODE_PHASES:
                    if phase in runs[key]:
                        print_run(fraction, key, runs[key][phase], resident[phase], phase)
            base = {option: getattr(args, option)[0] for option in OPTIONS}
            for option in (option for option in OPTIONS if len(getattr(args, option)) == 2):
                on, off = (runs[option_key(name, {**base, option: value})] for value in (True, False))
                print_option(fraction, name, option, on, off)
    return entry


def add_ratios(entry: dict) -> None:
    """Per fraction and mode: x_hf (speed-up over HF), x_none (over no prefetch; < 1 = prefetch loses) and
    x_pcie_bound (measured / bound; target <= 1.5 at 25%)."""
    entry["ratios"] = {}
    resident = entry.get("resident")
    for fraction, modes in entry["runs"].items():
        hf, baseline = (entry.get("hf") or {}).get(fraction), modes.get("none")
        hf = hf if hf and "error" not in hf else None
        for mode, run in modes.items():
            r = {}
            if hf:
                r["prefill_x_hf"] = run["prefill"]["tok_s"] / hf["prefill_tok_s"]
            for phase in (phase for phase in DECODE_PHASES if phase in run):
                name = f"{phase}_b"  # decode_b1_..., decode_sampled_b1_...
                for b, d in run[phase].items() if resident and mode != "resident" else ():
                    base = resident[phase][b]
                    r[f"{name}{b}_x_resident"] = d["tok_s"] / base["tok_s"]
                    # the target: a cached step within 1.3x of max(resident step, PCIe bound of the bytes it missed)
                    r[f"{name}{b}_x_target_bound"] = d["ms_per_step"] / max(base["ms_per_step"], d["pcie_bound_ms"])
                    if "pipelined_tok_s" in d and "pipelined_tok_s" in base:
                        r[f"{name}{b}_pipelined_x_resident"] = d["pipelined_tok_s"] / base["pipelined_tok_s"]
                for b, d in run[phase].items():
                    r[f"{name}{b}_x_pcie_bound"] = d["x_pcie_bound"]
                    if hf:  # accelerate copies every host-mapped block each forward, whatever the tokens
                        r[f"{name}{b}_x_hf"] = hf["decode_ms"][b] / d["ms_per_step"]
                    if baseline is not None and mode != "none":
                        r[f"{name}{b}_x_none"] = d["tok_s"] / baseline[phase][b]["tok_s"]
            entry["ratios"].setdefault(fraction, {})[mode] = r


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--model", help="a converted Colibri model directory to run instead of --shapes")
    parser.add_argument(
        "--prompts",
        help="text to take prompts from (tokenised with the model's tokenizer.json); default: uniform random token ids",
    )
    parser.add_argument(
        "--table",
        help="routing table for the plan prefetch (with --model; default: "
        "MODEL/routing_table.bin); without --model one is traced from random ids",
    )
    parser.add_argument("--hf-model", help="the Hugging Face checkpoint --model was converted from (the reference)")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    parser.add_argument("--prefetch-modes", default=",".join(PREFETCH_MODES))
    parser.add_argument("--decode-steps", type=int, default=DECODE_STEPS, help="timed decode steps per batch size")
    parser.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--workdir", default="/dev/shm/colibri-offload")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--policy", choices=POLICIES, default="lru", help="the expert cache's replacement policy")
    parser.add_argument(
        "--temperature",
        type=float,
        default=SAMPLED_TEMPERATURE,
        help="the decode phases also run with continuations sampled at this temperature (fixed seeds), beside the "
        "greedy ones; 0: greedy only",
    )
    parser.add_argument(
        "--plan-source",
        choices=("worker", "router"),
        default="worker",
        help="where the plan prefetch's plan comes from: the worker's own lookup of each step's tokens in the table "
        "(on the device on cuda; steps then also run two in flight, as served) or the router's plan sent with "
        "each step",
    )
    parser.add_argument(
        "--plan-top-k",
        help="run each plan mode once per k (1,2): with the table's k most likely predictions a token, keyed "
        "MODE/topK below the table's own k (default: the table as it is)",
    )
    parser.add_argument(
        "--plan-min-share",
        help="also run each plan mode once per F (0.3,0.5) with the table gated by share, keyed MODE/shareF (needs "
        "the table's counts file: colibri router-gen --save-counts)",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="cuda: record one more decode step per batch size kernel by kernel (streams, waits) into the JSON",
    )
    for option in OPTIONS:  # each run keyed by the options it changes (option_key)
        default = "on" if getattr(CudaOptions(), option) else "off"
        help_text = f"CudaOptions.{option} of the cached runs: on, off or on,off (both, side by side)"
        parser.add_argument("--" + option.replace("_", "-"), default=default, help=help_text)
    parser.add_argument(
        "--expert-dtype",
        default=None,
        help="convert the --shapes models' experts to this dtype (int8, fp8, ...; default bf16); a --model "
        "directory keeps the experts it was converted with",
    )
    args = parser.parse_args(argv)
    if args.expert_dtype is not None and args.model:
        parser.error(
            "--expert-dtype: converts the --shapes models; convert --model with colibri convert --expert-dtype"
        )
    args.fractions = [float(f) for f in args.fractions.split(",")]
    args.prefetch_modes = args.prefetch_modes.split(",")
    if bad := [m for m in args.prefetch_modes if m not in PREFETCH_MODES]:
        parser.error(f"--prefetch-modes: {bad} not in {', '.join(PREFETCH_MODES)}")
    settings = {"on": True, "off": False}
    for option in OPTIONS:
        values = [settings.get(v, v) for v in dict.fromkeys(getattr(args, option).split(","))]
        if bad := [v for v in values if not isinstance(v, bool)]:
            parser.error(f"--{option.replace('_', '-')}: {bad} not in on, off")
        default = getattr(CudaOptions(), option)
        setattr(args, option, sorted(values, key=lambda v, d=default: v != d))  # the default first: MODE's key
    if not (np.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature: a finite number >= 0, got {args.temperature}")
    if args.decode_steps < 1:
        parser.error(f"--decode-steps: must be >= 1, got {args.decode_steps}")
    try:
        args.plan_top_k = parse_plan_top_k(args.plan_top_k)
        args.plan_min_share = parse_plan_min_share(args.plan_min_share)
        for flag in ("plan_top_k", "plan_min_share"):
            if getattr(args, flag) and not any("plan" in m for m in args.prefetch_modes):
                parser.error(f"--{flag.replace('_', '-')}: no plan mode in --prefetch-modes")
        model_input = _check_model_args(parser, args)
    except ColibriError as e:
        parser.error(str(e))
    if not args.skip_hf and args.shapes != TINY and importlib.util.find_spec("accelerate") is None:
        parser.error("the HF reference needs accelerate (pip install 'accelerate>=1.15'); or pass --skip-hf")
    measured = measure_pcie()
    bytes_per_s = measured or NOMINAL_PCIE_BYTES_PER_S
    results = {
        "backend": args.backend,
        "device": _device_name(),
        "pcie_bytes_per_s": bytes_per_s,
        "pcie_measured": measured is not None,
        "expert_dtype": args.expert_dtype or "as converted",
        "shapes": {},
        "note": "bytes copied count demand and prefetch copies; the PCIe bound is bytes copied per step / "
        "pcie_bytes_per_s" + ("" if measured else " (nominal 55 GB/s: no GPU to measure it)"),
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [Path(args.model).name] if model_input else args.shapes.split(",")
    for name in names:
        workdir = Path(args.workdir) / name
        base = None
        if model_input:
            model, tokens = model_input
        else:
            model_dir, base = _build_shape(name, workdir, args.expert_dtype)
            model = ModelDir.open(model_dir, verify=False)
            tokens = _token_source(model, args.prompts)

        def saved(entry, name=name):  # the runs so far, marked partial, in case the call is stopped
            results["shapes"][name] = {**entry, "partial": True}
            (out_dir / "offload.json").write_text(json.dumps(results, indent=1))

        entry = bench_shape(model, args, bytes_per_s, workdir, tokens, saved)
        entry["hf"] = None
        results["shapes"][name] = entry
        (out_dir / "offload.json").write_text(json.dumps(results, indent=1))  # Colibri's runs, before HF
        if not args.skip_hf and (base is not None or model_input):
            entry["hf"] = bench_hf_budgets(entry, base if base is not None else Path(args.hf_model), tokens)
        add_ratios(entry)
        del base, model
        gc.collect()
        shutil.rmtree(workdir, ignore_errors=True)
        results["shapes"][name] = entry
        (out_dir / "offload.json").write_text(json.dumps(results, indent=1))
        print_offload(name, entry)
    plot_offload(results, out_dir / "offload.png")
    return 0


def _build_shape(name: str, workdir: Path, expert_dtype: str | None = None):
    """A reference shape's random bf16 model: (its Colibri model directory, the HF model on the host or None);
    its experts converted to `expert_dtype` when given."""
    if name == TINY:
        from expert_service.tools.tiny_model import make_tiny

        return make_tiny(workdir / "model", family="mixtral", expert_dtype=expert_dtype), None
    import torch

    base = build_hf(*SHAPES[name])
    model_dir = write_colibri(base, workdir / "model", expert_dtype)
    base.to("cpu")  # HF waits on the host while Colibri has the GPU
    torch.cuda.empty_cache()
    return model_dir, base


def _token_source(model: ModelDir, prompts: str | None) -> TokenSource:
    longest = max(PREFILL_TOKENS, DECODE_CONTEXT)
    return text_source(model, prompts, longest) if prompts else TokenSource(model.config.vocab_size)


def _check_model_args(parser, args) -> tuple[ModelDir, TokenSource] | None:
    """--model, --table, --hf-model and --prompts checked before anything runs; (model, prompts) with --model."""
    if args.model is None:
        for flag in ("table", "hf_model"):
            if getattr(args, flag) is not None:
                parser.error(f"--{flag.replace('_', '-')} needs --model")
        if args.shapes != TINY and args.prompts:
            parser.error("--prompts needs a model with a tokenizer: --model DIR (or --shapes tiny)")
        return None
    if not args.skip_hf and args.hf_model is None:
        parser.error(
            "--model: the HF reference needs --hf-model HF_DIR (the checkpoint --model was converted "
            "from); or pass --skip-hf"
        )
    if not args.skip_hf and not (Path(args.hf_model) / "config.json").is_file():
        parser.error(
            f"--hf-model: {args.hf_model} has no config.json (expected the checkpoint --model was converted from)"
        )
    model = open_model(args.model)
    default_table = model.path / "routing_table.bin"
    if args.table is None and (default_table.is_file() or any("plan" in m for m in args.prefetch_modes)):
        args.table = str(default_table)
    if args.table is not None:  # a missing or mismatched table (or counts file) fails now, not after an hour
        check_plan_cuts(load_table(model, args.table)[0], Path(args.table), args.plan_top_k, args.plan_min_share)
    return model, _token_source(model, args.prompts)


def _device_name() -> str:
    if not cuda_available():
        return "cpu"
    from numba import cuda

    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


if __name__ == "__main__":
    sys.exit(main())
