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

import gc
import itertools
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import SHAPES, build_hf, write_colibri  # noqa: E402
from bench.offload_args import TINY, parse_args, token_source  # noqa: E402
from bench.offload_hf import bench_hf_budgets  # noqa: E402
from bench.offload_measure import (  # noqa: E402
    bench_colibri,  # bench_shape calls it and make_engine by this module's names: tests replace them here
    close,
    device_name,
    make_engine,
    measure_fetch_kernel,
    measure_pcie,
)
from bench.offload_model import TokenSource, load_table  # noqa: E402
from bench.offload_plan import build_routing_table, cut_fields, own_cut, plan_runs, plan_tables  # noqa: E402
from bench.offload_report import (  # noqa: E402
    CUDA_OPTIONS,
    DECODE_PHASES,
    OPTIONS,
    option_key,
    plot_offload,
    print_offload,
    print_option,
    print_run,
)
from common.model_format import ModelDir  # noqa: E402
from expert_service.engine.cuda_options import CudaOptions  # noqa: E402
from expert_service.experts.slots import plan_slots  # noqa: E402

NOMINAL_PCIE_BYTES_PER_S = 55e9  # pinned host->device on the H200; used only when no GPU can measure it


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
                cuda = CudaOptions(**{k: v for k, v in settings.items() if k in CUDA_OPTIONS})
                large_steps = settings["prefetch_large_steps"]
                cached = make_engine(model, args.backend, n, mode, cuda, plan_table, args.policy, large_steps)
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
    args, model_input = parse_args(argv, __doc__)
    measured = measure_pcie()
    bytes_per_s = measured or NOMINAL_PCIE_BYTES_PER_S
    results = {
        "backend": args.backend,
        "device": device_name(),
        "pcie_bytes_per_s": bytes_per_s,
        "pcie_measured": measured is not None,
        # what the cuda backend's device-driven miss copies reach on this host, against the copy engine
        "fetch_kernel": measure_fetch_kernel() if measured and args.backend == "cuda" else None,
        "expert_dtype": args.expert_dtype or "as converted",
        "shapes": {},
        "note": "bytes copied count demand and prefetch copies; the PCIe bound is bytes copied per step / "
        "pcie_bytes_per_s" + ("" if measured else " (nominal 55 GB/s: no GPU to measure it)"),
    }
    if results["fetch_kernel"]:
        fk = results["fetch_kernel"]
        print(
            f"host->device: copy engine {bytes_per_s / 1e9:.1f} GB/s (the PCIe bound's rate); the fetch kernel that "
            f"copies a cached step's misses {fk['bytes_per_s'] / 1e9:.1f} GB/s ({fk['x_copy_engine']:.2f}x, this "
            "host's): steps made of misses run at >= 1/that x the bound",
            flush=True,
        )
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
            tokens = token_source(model, args.prompts)

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


if __name__ == "__main__":
    sys.exit(main())
