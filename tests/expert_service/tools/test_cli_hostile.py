"""The offline subcommands against a careless operator: blank paths, output files that cannot or must not be
written, malformed token id lists, a broken tokenizer. Each is one line naming the flag or file, with its exit code,
and nothing written half."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from colibri.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# --- blank paths ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("blank", ["", "  "])
def test_make_tiny_refuses_a_blank_out_dir_rather_than_writing_into_the_working_directory(
    tmp_path, monkeypatch, capsys, blank
):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(capsys, "make-tiny", blank, "--no-progress")
    assert (rc, out, err) == (2, "", "colibri make-tiny: error: OUT_DIR: empty (name the model directory to write)\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv, named",
    [
        (["verify", "", "--no-progress"], "MODEL_DIR"),
        (["router-gen", "", "--no-progress"], "MODEL_DIR"),
        (["logits", "--model", "", "--tokens", "1", "--out", "l.npy"], "--model"),
        (["complete", "--model", "", "--tokens", "1"], "--model"),
    ],
)
def test_a_blank_model_dir_is_refused_not_read_from_the_working_directory(
    tiny_model, tmp_path, monkeypatch, capsys, argv, named
):
    """Run inside a model directory, a blank path (an unset shell variable) used that model without a word."""
    workdir = Path(shutil.copytree(tiny_model, tmp_path / "here", ignore=shutil.ignore_patterns("hf")))
    monkeypatch.chdir(workdir)
    before = sorted(p.name for p in workdir.iterdir())
    rc, out, err = run_cli(capsys, *argv)
    assert (rc, out) == (2, ""), (rc, out, err)
    assert (
        err.startswith(f"colibri {argv[0]}: error: {named}: empty (name the model directory") and err.count("\n") == 1
    ), err
    assert sorted(p.name for p in workdir.iterdir()) == before
