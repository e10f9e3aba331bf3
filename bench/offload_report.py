"""bench/offload.py's results as text: the console table, the PNG, and the markdown tables for the docs.

    python bench/offload_report.py RESULTS_DIR        # markdown for docs/expert-cache.md, routing.md, default-model.md

RESULTS_DIR is searched for offload.json (bench/offload.py), recall.json (bench/table_recall.py),
training_log.json (training/train.py) and routing_table.bin.report.json (colibri router-gen); each table is
printed when its file is there. Prefetch modes are named as in the docs: plan = the table, plan+lookahead =
both.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.plotting import pyplot  # noqa: E402
from expert_service.engine.config import EngineConfig  # noqa: E402
from expert_service.engine.cuda_options import CudaOptions  # noqa: E402

MODE_NAMES = {
    "resident": "all resident",
    "none": "none",
    "plan": "table",
    "lookahead": "lookahead",
    "plan+lookahead": "both",
}


def mode_name(key: str) -> str:
    """A run's key as the docs name it: "plan/top1" -> "table top-1" (the table's most likely prediction alone),
    "plan/share0.3" -> "table share>=0.3" (its predictions with a share of 0.3 or more)."""
    mode, *rest = key.split("/")
    cuts = [
        f"top-{r[3:]}" if r.startswith("top") and r[3:].isdigit() else f"share>={r[5:]}" if r.startswith("share") else r
        for r in rest
    ]
    return " ".join([MODE_NAMES.get(mode, mode), *cuts])


def _fmt(v, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


# bench_colibri's decode phases: greedy continuations, and sampled ones (--temperature > 0)
DECODE_PHASES = ("decode", "decode_sampled")


def print_run(fraction: float, key: str, decode: dict, base: dict, phase: str = "decode") -> None:
    """One cached run's decode line (one phase), against the resident engine's `base` decode of the same run."""
    line = ", ".join(
        f"b={b} {d['tok_s']:.1f} tok/s ({d['tok_s'] / base[b]['tok_s']:.2f}x resident, "
        f"{d['ms_per_step'] / max(base[b]['ms_per_step'], d['pcie_bound_ms']):.2f}x max(resident, PCIe bound))"
        for b, d in decode.items()
    )
    label = "decode" if phase == "decode" else "sampled"
    print(f"{fraction:>6} {key:<15} {label} {line}", flush=True)


# the CudaOptions fields bench/offload.py can vary, and the EngineConfig switches it varies the same way
CUDA_OPTIONS = ("cached_gemv", "pipelined_waves", "cached_mma", "cached_mma_large", "prefetch_yields")
ENGINE_OPTIONS = ("prefetch_large_steps",)
OPTIONS = CUDA_OPTIONS + ENGINE_OPTIONS


def option_defaults(cuda: CudaOptions = CudaOptions()) -> dict[str, bool]:
    """Each option's default: the CudaOptions field's, or the EngineConfig setting's."""
    engine = EngineConfig()
    return {name: getattr(cuda if name in CUDA_OPTIONS else engine, name) for name in OPTIONS}


def option_key(mode: str, settings: dict[str, bool], defaults: CudaOptions = CudaOptions()) -> str:
    """A cached run's key: the prefetch mode, then each option the run sets off its default
    ("/no-cached-gemv" for a field on by default, "/cached-gemv" for one off by default)."""
    default = option_defaults(defaults)
    changed = (name for name in OPTIONS if settings.get(name, default[name]) != default[name])
    return mode + "".join(f"/{'no-' if default[n] else ''}{n.replace('_', '-')}" for n in changed)


def print_option(fraction: float, mode: str, option: str, on: dict, off: dict) -> None:
    """The same cached run (bench_colibri's result) with an option on and off: step times side by side
    (on / off) and how many times faster the run with it on is (off / on), decode at each batch size and prefill."""
    steps = [(f"b={b}", on["decode"][b], off["decode"][b]) for b in on["decode"]]
    steps.append(("prefill", on["prefill"], off["prefill"]))
    line = ", ".join(
        f"{name} {a['ms_per_step']:.3f}/{b['ms_per_step']:.3f} (on {b['ms_per_step'] / a['ms_per_step']:.2f}x faster)"
        for name, a, b in steps
    )
    print(f"{fraction:>6} {mode:<15} ms per step with {option} on/off: {line}", flush=True)


def print_offload(name: str, entry: dict) -> None:
    """The console summary bench/offload.py prints after each model."""
    print(
        f"\n{name}: {entry['num_experts']} experts x {entry['num_moe_layers']} MoE layers, "
        f"{entry['expert_bytes'] / 2**30:.2f} GiB of experts"
    )
    print(
        f"{'budget':>7} {'prefetch':<15}{'b1 tok/s':>10}{'b16 tok/s':>11}{'prefill':>10}{'hit b16':>9}"
        f"{'MB/tok b16':>11}{'stall b16':>10}{'xPCIe b1/b16':>14}{'xHF b1/b16':>13}{'xnone b1/b16':>14}"
    )
    for fraction, modes in entry["runs"].items():
        for mode, run in modes.items():
            d1, d16, r = run["decode"]["1"], run["decode"]["16"], entry["ratios"][fraction][mode]
            print(
                f"{float(fraction):>7.3f} {mode:<15}{d1['tok_s']:>10.1f}{d16['tok_s']:>11.1f}"
                f"{run['prefill']['tok_s']:>10.0f}{d16['hit_rate']:>9.2f}{d16['bytes_copied_per_token'] / 1e6:>11.3g}"
                f"{d16['stall_fraction']:>10.2f}{_fmt(d1['x_pcie_bound']) + '/' + _fmt(d16['x_pcie_bound']):>14}"
                f"{_fmt(r.get('decode_b1_x_hf')) + '/' + _fmt(r.get('decode_b16_x_hf')):>13}"
                f"{_fmt(r.get('decode_b1_x_none')) + '/' + _fmt(r.get('decode_b16_x_none')):>14}"
            )
    sampled = _sampled_runs(entry)
    if sampled:
        temperature = sampled[0][2]["sampled_temperature"]
        print(f"continuations sampled at temperature {temperature:g} (fixed seeds):")
        print(
            f"{'budget':>7} {'prefetch':<15}{'b1 tok/s':>10}{'b16 tok/s':>11}{'hit b1/b16':>12}{'MB/tok b1/b16':>15}"
            f"{'xbound b1/b16':>15}{'xnone b1/b16':>14}"
        )
        for fraction, mode, run in sampled:
            d1, d16, r = run["decode_sampled"]["1"], run["decode_sampled"]["16"], entry["ratios"][fraction][mode]
            print(
                f"{float(fraction):>7.3f} {mode:<15}{d1['tok_s']:>10.1f}{d16['tok_s']:>11.1f}"
                f"{d1['hit_rate']:>6.2f}/{d16['hit_rate']:<5.2f}"
                f"{d1['bytes_copied_per_token'] / 1e6:>8.3g}/{d16['bytes_copied_per_token'] / 1e6:<6.3g}"
                f"{_fmt(r.get('decode_sampled_b1_x_target_bound')) + '/' + _fmt(r.get('decode_sampled_b16_x_target_bound')):>15}"
                f"{_fmt(r.get('decode_sampled_b1_x_none')) + '/' + _fmt(r.get('decode_sampled_b16_x_none')):>14}"
            )
        print("xbound: step / max(resident step, PCIe bound of the bytes missed), target <= 1.3")
    print("targets at 0.25: xPCIe <= 1.5, xHF >= 10; xnone < 1: prefetch loses", flush=True)


def plot_offload(results: dict, path: Path) -> None:
    """Decode tok/s against the expert budget, one panel per model and batch size, every prefetch mode and HF."""
    plt = pyplot()
    if plt is None:
        return
    shapes = results["shapes"]
    batches = sorted(
        {b for e in shapes.values() for m in e["runs"].values() for r in m.values() for b in r["decode"]}, key=int
    )
    fig, axes = plt.subplots(len(batches), len(shapes), figsize=(6 * len(shapes), 4 * len(batches)), squeeze=False)
    for col, (name, entry) in enumerate(shapes.items()):
        resident = {f: m["resident"] for f, m in entry["runs"].items() if "resident" in m}
        modes = list(dict.fromkeys(mode for m in entry["runs"].values() for mode in m if mode != "resident"))
        for row, b in enumerate(batches):
            ax = axes[row][col]
            for mode in modes:
                points = sorted(
                    (float(f), m[mode]["decode"][b]["tok_s"]) for f, m in entry["runs"].items() if mode in m
                )
                points += [(float(f), r["decode"][b]["tok_s"]) for f, r in resident.items()]
                ax.plot(*zip(*sorted(points)), marker="o", label=f"colibri, prefetch {mode_name(mode)}")
            hf = sorted(
                (float(f), int(b) * 1e3 / h["decode_ms"][b])
                for f, h in (entry.get("hf") or {}).items()
                if "error" not in h
            )
            if hf:
                ax.plot(*zip(*hf), "k--", marker="x", label="transformers + accelerate offload")
            ax.set(
                xscale="log",
                yscale="log",
                xlabel="expert cache / expert bytes",
                ylabel="decode tok/s",
                title=f"{name}, b={b}",
            )
            ax.set_xticks([float(f) for f in entry["runs"]], [f"{float(f):g}" for f in entry["runs"]])
            ax.minorticks_off()
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _fetch_kernel_words(fetch: dict | None) -> str:
    """The fetch kernel's rate beside the copy engine's (runs from before the field, or on the cpu: nothing)."""
    if not fetch:
        return ""
    return f", the fetch kernel {fetch['bytes_per_s'] / 1e9:.1f} GB/s ({fetch['x_copy_engine']:.2f}x)"


def offload_markdown(results: dict) -> str:
    """Per model: the cache counts table and the speed table, every budget and prefetch mode, HF beside it."""
    out = []
    for name, e in results["shapes"].items():
        bw = results["pcie_bytes_per_s"] / 1e9
        out.append(
            f"**{name}**: {e['num_experts']} experts x {e['num_moe_layers']} MoE layers, top-{e['top_k']}, "
            f"{e['expert_bytes'] / 1e6:,.0f} MB of experts ({e['expert_block_bytes'] / 1e6:.2f} MB a block); "
            f"host->device {bw:.1f} GB/s{' (measured)' if results['pcie_measured'] else ' (nominal)'}"
            f"{_fetch_kernel_words(results.get('fetch_kernel'))}; "
            f"prompts: {_describe_prompts(e.get('prompts'))}.\n"
        )
        counts, speed = [], []
        for fraction, modes in e["runs"].items():
            budget = f"{float(fraction):.0%} ({next(iter(modes.values()))['slots_per_layer']} slots)"
            for mode, run in modes.items():
                d1, d16, r = run["decode"]["1"], run["decode"]["16"], e["ratios"][fraction][mode]
                counts.append(
                    [
                        budget,
                        mode_name(mode),
                        _fmt(d1["hit_rate"], ".3f"),
                        _fmt(d16["hit_rate"], ".3f"),
                        f"{d1['bytes_copied_per_token'] / 1e6:.2f}",
                        f"{d16['bytes_copied_per_token'] / 1e6:.2f}",
                        f"{d1['prefetches_issued']} / {d1['prefetches_used']}",
                        f"{d16['prefetches_issued']} / {d16['prefetches_used']}",
                        _fmt(d1["plan_recall"], ".3f"),
                        _fmt(d16["plan_recall"], ".3f"),
                    ]
                )
                speed.append(
                    [
                        budget,
                        mode_name(mode),
                        f"{d1['tok_s']:.1f}",
                        _fmt(d1["x_pcie_bound"]),
                        _fmt(r.get("decode_b1_x_hf"), ".1f"),
                        _fmt(r.get("decode_b1_x_none")),
                        f"{d16['tok_s']:.1f}",
                        _fmt(d16["x_pcie_bound"]),
                        _fmt(r.get("decode_b16_x_hf"), ".1f"),
                        _fmt(r.get("decode_b16_x_none")),
                        f"{d16['stall_fraction']:.2f}",
                        f"{run['prefill']['tok_s']:.0f}",
                        _fmt(r.get("prefill_x_hf"), ".1f"),
                    ]
                )
        steps = next(iter(next(iter(e["runs"].values())).values()))["decode"]["1"]["steps"]
        out.append(f"Expert-cache counts over the {steps} timed decode steps at each batch size (b=1 | b=16):\n")
        out.append(
            _table(
                [
                    "expert budget",
                    "prefetch",
                    "hit rate b=1",
                    "hit rate b=16",
                    "MB copied / token b=1",
                    "MB copied / token b=16",
                    "prefetches issued / used b=1",
                    "issued / used b=16",
                    "plan recall b=1",
                    "plan recall b=16",
                ],
                counts,
            )
        )
        out.append("\nSpeed (decode: median step; prefill 1 x 512, best of 3):\n")
        out.append(
            _table(
                [
                    "expert budget",
                    "prefetch",
                    "decode b=1 tok/s",
                    "× PCIe bound",
                    "× HF",
                    "× none",
                    "decode b=16 tok/s",
                    "× PCIe bound",
                    "× HF",
                    "× none",
                    "stall share b=16",
                    "prefill tok/s",
                    "× HF",
                ],
                speed,
            )
        )
        sampled = _sampled_runs(e)
        if sampled:
            out.append(
                f"\nContinuations sampled at temperature {sampled[0][2]['sampled_temperature']:g} (seed = request id; "
                "new prompts from the same source):\n"
            )
            out.append(_table(SAMPLED_HEADER, [_sampled_row(f, m, run, e["ratios"][f][m]) for f, m, run in sampled]))
        if e.get("hf"):
            rows = []
            for fraction, h in e["hf"].items():
                if "error" in h:
                    rows.append([f"{float(fraction):.0%}", "error: " + h["error"][:80], "", "", ""])
                    continue
                rows.append(
                    [
                        f"{float(fraction):.0%}",
                        ", ".join(h["offloaded_modules"]) or "none",
                        f"{1e3 / h['decode_ms']['1']:.1f}",
                        f"{16e3 / h['decode_ms']['16']:.1f}",
                        f"{h['prefill_tok_s']:.0f}",
                    ]
                )
            out.append("\ntransformers + accelerate at the same device budget:\n")
            out.append(
                _table(
                    [
                        "expert budget",
                        "MoE blocks on the host",
                        "decode b=1 tok/s",
                        "decode b=16 tok/s",
                        "prefill tok/s",
                    ],
                    rows,
                )
            )
        out.append("")
    return "\n".join(out)


SAMPLED_HEADER = [
    "expert budget",
    "prefetch",
    "decode b=1 tok/s",
    "hit rate b=1",
    "MB copied / token b=1",
    "× max(resident, PCIe bound) b=1",
    "× none b=1",
    "decode b=16 tok/s",
    "hit rate b=16",
    "MB copied / token b=16",
    "× max(resident, PCIe bound) b=16",
    "× none b=16",
]


def _sampled_runs(entry: dict) -> list[tuple[str, str, dict]]:
    """(fraction, mode, run) of every run that decoded sampled continuations, in the runs' order."""
    return [(f, m, run) for f, modes in entry["runs"].items() for m, run in modes.items() if "decode_sampled" in run]


def _sampled_row(fraction: str, mode: str, run: dict, r: dict) -> list[str]:
    row = [f"{float(fraction):.0%} ({run['slots_per_layer']} slots)", mode_name(mode)]
    for b in ("1", "16"):
        d = run["decode_sampled"][b]
        row += [
            f"{d['tok_s']:.1f}",
            _fmt(d["hit_rate"], ".3f"),
            f"{d['bytes_copied_per_token'] / 1e6:.2f}",
            _fmt(r.get(f"decode_sampled_b{b}_x_target_bound")),
            _fmt(r.get(f"decode_sampled_b{b}_x_none")),
        ]
    return row


def _describe_prompts(p: dict | None) -> str:
    if not p or p.get("kind") != "text slices":
        return "uniform random token ids"
    return f"slices of {Path(p['file']).name} ({p['tokens']:,} tokens)"


def recall_markdown(recall: dict) -> str:
    layers = recall["moe_layers"]
    rows = [
        [
            "table from the training split",
            *(f"{r:.3f}" for r in recall["recall_per_layer"]),
            f"**{recall['recall']:.3f}**",
        ],
        [
            "embedding fallback alone",
            *(f"{r:.3f}" for r in recall["fallback_recall_per_layer"]),
            f"{recall['fallback_recall']:.3f}",
        ],
        [
            f"chance (k/E = {recall['top_k']}/{recall['num_experts']})",
            *[f"{recall['chance_recall']:.3f}"] * (len(layers) + 1),
        ],
    ]
    # bench/table_recall.py's precision by rank: how often the table's j-th prediction is among the exact experts
    for j, (per_layer, mean) in enumerate(
        zip(recall.get("precision_per_rank", []), recall.get("precision_by_rank", []))
    ):
        rows.append([f"precision of rank {j + 1}", *(f"{p:.3f}" for p in per_layer), f"**{mean:.3f}**"])
    unseen = recall.get("heldout_unseen_share")
    note = (
        f"Top-{recall['top_k']} recall on {recall['tokens']:,} held-out tokens ({Path(recall['text']).name}, "
        f"{recall['sequences']} sequences of {recall['sequence_length']})"
        + ("" if unseen is None else f"; {100 * unseen:.1f} % of them never seen in the training split")
        + ":\n"
    )
    return note + "\n" + _table(["layer", *map(str, layers), "overall"], rows)


def training_markdown(log: dict) -> str:
    p, f = log["model"]["parameters"], log["final"]
    rows = [
        ["parameters", f"{p['total'] / 1e6:.1f} M total, {p['active_per_token'] / 1e6:.1f} M active per token"],
        [
            "training",
            f"{log['steps']} steps (asked {log['steps_requested']}) x {log['model']['batch_size']} x "
            f"{log['model']['sequence_length']:,} tokens ({log['tokens_seen'] / 1e6:.1f} M tokens), "
            f"{log['wall_s']} s on one {log['device']}",
        ],
        ["best step", str(log["best_step"])],
        [
            "held-out perplexity",
            f"{f['heldout_perplexity']:.1f} (cross-entropy {f['heldout_ce']:.3f} nats, "
            f"{f['heldout_bits_per_character']:.3f} bits per character)",
        ],
        ["validation perplexity", f"{f['validation_perplexity']:.1f}"],
    ]
    loads = log.get("expert_load_heldout") or []
    if loads:
        worst = max(loads, key=lambda r: r["max_over_ideal"])
        rows.append(
            [
                "expert load (held out)",
                f"max share / ideal {min(r['max_over_ideal'] for r in loads):.2f}-"
                f"{worst['max_over_ideal']:.2f} over layers, normalised entropy "
                f"{min(r['normalized_entropy'] for r in loads):.3f} at worst",
            ]
        )
    return _table(["", ""], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="folder holding the run's JSON files (searched recursively)")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        parser.error(f"{args.results}: not a folder")
    found = {
        name: next(iter(sorted(args.results.rglob(name))), None)
        for name in ("training_log.json", "recall.json", "offload.json")
    }
    if not any(found.values()):
        parser.error(f"{args.results}: none of {', '.join(found)} found")
    sections = [
        ("Training (docs/default-model.md)", "training_log.json", training_markdown),
        ("Held-out recall (docs/routing.md, docs/default-model.md)", "recall.json", recall_markdown),
        ("Offload (docs/expert-cache.md)", "offload.json", offload_markdown),
    ]
    for title, name, render in sections:
        if found[name] is not None:
            print(f"## {title}\n\n<!-- {found[name]} -->\n\n{render(json.loads(found[name].read_text()))}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
