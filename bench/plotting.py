"""matplotlib for the benches' PNGs, headless; None when it is not installed (the JSON is the result)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def pyplot(note_missing: bool = False):
    """matplotlib.pyplot on the Agg backend, or None (note_missing: saying so on stderr) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        if note_missing:
            print("matplotlib not installed: no PNG (pip install -e '.[bench]')", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_serve(results: dict, path) -> None:
    """bench/serve.py's figure: per model, ITL p50, throughput and TTFT p50 against the client count, served
    (each pipeline depth) and the engine alone."""
    plt = pyplot(note_missing=True)
    if plt is None:
        return
    models = results["models"]
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 4 * len(models)), squeeze=False)
    for row, (name, entry) in zip(axes, models.items()):
        e = entry["engine"]["batches"]
        ns = [int(n) for n in e]
        panels = [
            (
                "inter-token latency p50 (ms)",
                lambda s: s["itl_ms"]["p50"],
                [e[str(n)]["decode_step_ms"]["p50"] for n in ns],
                "engine decode step",
            ),
            (
                "throughput (tok/s)",
                lambda s: s["throughput_tok_s"],
                [e[str(n)]["tok_s"] for n in ns],
                "engine B / step",
            ),
            (
                "TTFT p50 (ms)",
                lambda s: s["ttft_ms"]["p50"],
                [e[str(n)]["prefill_all_ms"] for n in ns],
                "engine prefill of N prompts",
            ),
        ]
        for ax, (label, pick, engine_values, engine_label) in zip(row, panels):
            ax.plot(ns, engine_values, "k--o", label=engine_label)
            for depth, by_n in entry["served"].items():
                ax.plot(
                    [int(n) for n in by_n],
                    [pick(s) for s in by_n.values()],
                    "-o",
                    label=f"served, pipeline depth {depth}",
                )
            ax.set(
                xscale="log",
                xticks=ns,
                xticklabels=[str(n) for n in ns],
                xlabel="concurrent clients (= batch)",
                ylabel=label,
                title=f"{name}: {label.split(' (')[0]}",
            )
            ax.minorticks_off()
            ax.legend(fontsize=8)
    fig.suptitle(f"served vs engine alone -- {results['device']} ({results['machine']})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


WORKLOADS = ("shared", "unshared", "multiturn")


def plot_serve_prefix(results: dict, path) -> bool:
    """bench/serve.py --workload prefix's figure: per model, TTFT p50 and throughput with prefix caching on and
    off for each workload (bars: the medians; dots: each measured round), each panel's on/off ratio above its
    bars with the target where one is set. False (no PNG) without matplotlib."""
    plt = pyplot(note_missing=True)
    if plt is None:
        return False
    models, targets = results["models"], results.get("targets", {})
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4.5 * len(models)), squeeze=False)
    metrics = [("TTFT p50 (ms)", "ttft_p50_ms", "ttft_p50"), ("throughput (tok/s)", "throughput_tok_s", "throughput")]
    for row, (name, entry) in zip(axes, models.items()):
        for ax, (label, key, ratio_key) in zip(row, metrics):
            for offset, setting, color in ((-0.2, "on", "tab:blue"), (0.2, "off", "tab:gray")):
                xs = [i + offset for i in range(len(WORKLOADS))]
                ax.bar(xs, [entry[setting][w][key] for w in WORKLOADS], 0.38, color=color, label=f"caching {setting}")
                for x, w in zip(xs, WORKLOADS):
                    rounds = [r[key] for r in entry[setting][w].get("rounds", [])]
                    ax.plot([x] * len(rounds), rounds, "k.", markersize=4)
            top = max(  # above every bar and round, so no label covers a dot
                max([entry[s][w][key], *(r[key] for r in entry[s][w].get("rounds", []))])
                for s in ("on", "off")
                for w in WORKLOADS
            )
            for i, w in enumerate(WORKLOADS):
                ratio_name = f"{w}_{ratio_key}_on_x_off"
                target = targets.get(ratio_name)
                text = f"{entry['ratios'][ratio_name]:.3f}x" + (f"\n(target {target[0]} {target[1]})" if target else "")
                ax.annotate(text, (i, top * 1.04), ha="center", va="bottom", fontsize=8)
            ax.set(
                xticks=range(len(WORKLOADS)),
                xticklabels=WORKLOADS,
                ylabel=label,
                ylim=(0, top * 1.3),
                title=f"{name}: {label.split(' (')[0]}, on / off",
            )
            ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(f"prefix caching on vs off -- {results['device']} ({results['machine']})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


PLOTS = {"serve-prefix": plot_serve_prefix}


def main(argv: list[str] | None = None) -> int:
    """Renders the PNG beside a stored result: python -m bench.plotting bench/results/<name>.json ..."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m bench.plotting RESULT.json [...]", file=sys.stderr)
        return 2
    for name in paths:
        path = Path(name)
        try:
            results = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"{path}: not a readable JSON result ({e})", file=sys.stderr)
            return 2
        plot = PLOTS.get(results.get("benchmark") if isinstance(results, dict) else None)
        if plot is None:
            print(f"{path}: benchmark is not one of {', '.join(PLOTS)}", file=sys.stderr)
            return 2
        if not plot(results, path.with_suffix(".png")):
            return 1
        print(f"wrote {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
