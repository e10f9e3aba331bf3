"""The training curve and the held-out expert load of a training log, as one PNG.

python -m training.plot training/default-model-hf/training_log.json docs/default-model-training.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on the training machine
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_training(log: dict, path: str | Path) -> None:
    fig, (curve_ax, load_ax) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    steps = [p["step"] for p in log["curve"]]
    curve_ax.plot(steps, [p["train_ce"] for p in log["curve"]], label="train cross-entropy", lw=1)
    curve_ax.plot(
        [e["step"] for e in log["evals"]],
        [e["validation_ce"] for e in log["evals"]],
        "o-",
        label="validation cross-entropy",
        ms=3,
    )
    final = log["final"]
    curve_ax.axhline(
        final["heldout_ce"],
        color="k",
        ls="--",
        lw=0.8,
        label=f"held-out books {final['heldout_ce']:.2f} (perplexity {final['heldout_perplexity']:.1f})",
    )
    curve_ax.axvline(log["best_step"], color="grey", ls=":", lw=0.8, label=f"checkpoint kept (step {log['best_step']})")
    aux = curve_ax.twinx()
    aux.plot(steps, [p["aux_loss"] for p in log["curve"]], color="tab:red", lw=0.6, alpha=0.6)
    aux.set_ylabel("load-balancing loss (red)", color="tab:red")
    curve_ax.set_xlabel("optimizer step")
    curve_ax.set_ylabel("nats per token")
    curve_ax.set_ylim(top=min(curve_ax.get_ylim()[1], log["curve"][0]["train_ce"] + 0.5))
    curve_ax.legend(loc="upper right", fontsize=8)
    curve_ax.set_title(
        f"{log['preset']} preset: {log['model']['parameters']['total'] / 1e6:.1f} M parameters, "
        f"{log['tokens_seen'] / 1e6:.0f} M tokens seen"
    )
    shares = np.array([layer["share"] for layer in log["expert_load_heldout"]])
    image = load_ax.imshow(shares * shares.shape[1], cmap="coolwarm", vmin=0, vmax=2, aspect="auto")
    load_ax.set_yticks(range(shares.shape[0]))
    load_ax.set_xticks(range(shares.shape[1]))
    load_ax.set_xlabel("expert")
    load_ax.set_ylabel("layer")
    load_ax.set_title("held-out expert load (share x experts; 1 = even)")
    fig.colorbar(image, ax=load_ax)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    plot_training(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])
