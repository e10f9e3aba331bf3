"""bench/offload_report.py: the markdown tables for the docs from a run's JSON files, and the PNG with a failed
HF reference."""

from __future__ import annotations

import copy
import json
import re
import shutil

import pytest

from bench import offload_report, table_recall
from training.corpus import DATA_DIR

TRAINING_LOG = DATA_DIR.parent / "default-model-hf" / "training_log.json"


@pytest.fixture(scope="module")
def results_dir(model_with_table, offload_run, tmp_path_factory):
    """A folder laid out like the GPU run's tarball: offload.json, recall.json and a training log."""
    model, table, prompts = model_with_table
    folder = tmp_path_factory.mktemp("results")
    shutil.copy(offload_run[0] / "offload.json", folder / "offload.json")
    assert (
        table_recall.main(
            [
                str(model.path),
                "--table",
                str(table),
                "--text",
                str(prompts),
                "--out",
                str(folder / "recall" / "recall.json"),
            ]
        )
        == 0
    )
    shutil.copy(TRAINING_LOG, folder / "training_log.json")
    return folder


def test_markdown_has_every_run_and_the_numbers_of_the_json(results_dir, capsys):
    assert offload_report.main([str(results_dir)]) == 0
    text = capsys.readouterr().out
    assert [t for t in re.findall(r"^## (.*)$", text, re.M)] == [
        "Training (docs/default-model.md)",
        "Held-out recall (docs/routing.md, docs/default-model.md)",
        "Offload (docs/expert-cache.md)",
    ]

    results = json.loads((results_dir / "offload.json").read_text())
    ((name, entry),) = results["shapes"].items()
    for mode, label in (("none", "none"), ("plan", "table")):
        run = entry["runs"]["0.5"][mode]
        d1, d16 = run["decode"]["1"], run["decode"]["16"]
        counts = f"| 50% ({run['slots_per_layer']} slots) | {label} | {d1['hit_rate']:.3f} | {d16['hit_rate']:.3f} | "
        assert counts in text, counts
        issued = f"| {d16['prefetches_issued']} / {d16['prefetches_used']} |"
        assert issued in text
        speed = f"| 50% ({run['slots_per_layer']} slots) | {label} | {d1['tok_s']:.1f} |"
        assert speed in text, speed
    assert "transformers + accelerate" not in text  # --skip-hf: no HF table

    recall = json.loads((results_dir / "recall" / "recall.json").read_text())
    row = "| table from the training split | " + " | ".join(f"{r:.3f}" for r in recall["recall_per_layer"])
    assert row + f" | **{recall['recall']:.3f}** |" in text
    assert "| chance (k/E = 2/4) | 0.500 | 0.500 | 0.500 |" in text
    for j, per_layer in enumerate(recall["precision_per_rank"]):
        row = f"| precision of rank {j + 1} | " + " | ".join(f"{p:.3f}" for p in per_layer)
        assert row + f" | **{recall['precision_by_rank'][j]:.3f}** |" in text

    log = json.loads(TRAINING_LOG.read_text())
    assert f"| training | {log['steps']} steps (asked {log['steps_requested']}) x 16 x 1,024 tokens" in text
    assert f"{log['final']['heldout_perplexity']:.1f} (cross-entropy" in text


def test_failed_hf_reference_is_a_row_and_no_plot_point(results_dir, tmp_path):
    results = json.loads((results_dir / "offload.json").read_text())
    entry = next(iter(results["shapes"].values()))
    entry["hf"] = {"0.5": {"budget_bytes": 123, "error": "OutOfMemoryError: CUDA out of memory"}}
    text = offload_report.offload_markdown(copy.deepcopy(results))
    assert "| 50% | error: OutOfMemoryError: CUDA out of memory |" in text
    pytest.importorskip("matplotlib")
    offload_report.plot_offload(results, tmp_path / "offload.png")
    assert (tmp_path / "offload.png").stat().st_size > 1000


def test_a_folder_without_results_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        offload_report.main([str(tmp_path)])
    assert exit_info.value.code == 2
    assert "none of training_log.json, recall.json, offload.json found" in capsys.readouterr().err
