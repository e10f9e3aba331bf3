"""matplotlib for the benches' PNGs, headless; None when it is not installed (the JSON is the result)."""

from __future__ import annotations

import sys


def pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_serve(results: dict, path) -> None:
    """bench/serve.py's figure: per model, ITL p50, throughput and TTFT p50 against the client count, served
    (each pipeline depth) and the engine alone."""
    plt = pyplot()
    if plt is None:
        print("matplotlib not installed: no PNG (pip install -e '.[bench]')", file=sys.stderr)
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
