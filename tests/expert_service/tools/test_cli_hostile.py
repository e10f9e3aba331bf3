"""The offline subcommands against a careless operator: blank paths, output files that cannot or must not be
written, malformed token id lists, a broken tokenizer. Each is one line naming the flag or file, with its exit code,
and nothing written half."""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri.cli import main
from expert_service.tools.tiny_model import VOCAB_SIZE
from tests.helpers import serve_env


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


# --- logits --out ----------------------------------------------------------------------------------------------


def limit_file_size(max_bytes: int):
    """For a child: writes past `max_bytes` fail with EFBIG, as a full disk fails them with ENOSPC (and SIGXFSZ,
    which would kill it, is ignored)."""

    def set_limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return set_limit


def test_logits_that_do_not_fit_leave_the_previous_file_whole(tiny_model, tmp_path):
    """The file was truncated in place (the old logits lost, a broken .npy left), and the error read
    '[Errno None] None' when numpy's short write had no errno."""
    out = tmp_path / "l.npy"
    old = os.urandom(int(np.random.default_rng().integers(100, 2000)))
    out.write_bytes(old)
    tokens = ",".join(str(t) for t in np.random.default_rng().integers(0, 259, 64))
    command = [sys.executable, "-m", "colibri.cli", "logits", "--model", str(tiny_model), "--tokens", tokens,
               "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, env=serve_env(), capture_output=True, preexec_fn=limit_file_size(16384))
    assert done.returncode == 1 and done.stdout == b"", done.stderr.decode()
    assert done.stderr.decode() == f"colibri logits: error: {out}: File too large\n"
    assert out.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.npy"]


def test_ctrl_c_while_logits_are_written_leaves_no_partial_file(tiny_model, tmp_path, monkeypatch, capsys):
    def interrupted_save(file, array):
        file.write(b"\x93NUMPY partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "save", interrupted_save)
    rc, out, err = run_cli(
        capsys, "logits", "--model", str(tiny_model), "--tokens", "1,2", "--out", str(tmp_path / "l")
    )
    assert (rc, out, err) == (130, "", "colibri logits: interrupted\n")
    assert list(tmp_path.iterdir()) == []


def test_logits_refuse_an_out_path_they_cannot_write_before_loading_the_model(tmp_path, capsys):
    """A model that does not exist is not even looked at: the unwritable --out was found only after the prefill."""
    rc, out, err = run_cli(capsys, "logits", "--model", str(tmp_path / "none"), "--tokens", "1", "--out", str(tmp_path))
    assert (rc, out, err) == (1, "", f"colibri logits: error: {tmp_path}: Is a directory\n")
    rc, out, err = run_cli(
        capsys, "logits", "--model", str(tmp_path / "none"), "--tokens", "1", "--out", str(tmp_path / "no" / "l.npy")
    )
    assert (rc, out, err) == (1, "", f"colibri logits: error: {tmp_path / 'no' / 'l.npy'}: No such file or directory\n")
    rc, out, err = run_cli(capsys, "logits", "--model", str(tmp_path / "none"), "--tokens", "1", "--out", "")
    assert (rc, out, err) == (2, "", "colibri logits: error: --out: empty (name the .npy file to write)\n")


# --- a model directory's files ------------------------------------------------------------------------------


@pytest.mark.timeout(120)  # opening the FIFO would wait for a writer for ever
@pytest.mark.parametrize(
    "name, kind",
    [(name, kind) for name in ("colibri.json", "dense.bin", "experts-L001.bin") for kind in ("a FIFO", "a directory")]
    + [("colibri.json", "a character device")],  # a tensor file may not link outside the directory (to /dev)
)
def test_a_model_file_that_is_no_regular_file_is_refused_saying_what_is_there(tiny_model, tmp_path, capsys, name, kind):
    """A FIFO, device or directory at a model file's name was reported as "not found"."""
    model = Path(shutil.copytree(tiny_model, tmp_path / "model", ignore=shutil.ignore_patterns("hf")))
    (model / name).unlink()
    if kind == "a FIFO":
        os.mkfifo(model / name)
    elif kind == "a directory":
        (model / name).mkdir()
    else:
        (model / name).symlink_to("/dev/null")
    rc, out, err = run_cli(capsys, "verify", str(model), "--no-progress")
    assert (rc, out) == (3, "") and err.count("\n") == 1, (rc, out, err)
    assert err.endswith(f"{model / name}: not a regular file ({kind})\n"), err


# --- complete's sampling flags ---------------------------------------------------------------------------------


def test_complete_sampling_errors_name_the_flag_typed(tiny_model, capsys):
    """They named SamplingParams' fields (top_k, seed), not the flags."""
    rng = random.Random()
    cases = [
        ("--top-k", str(-rng.randrange(1, 1 << 20)), "must be >= 0"),
        ("--top-p", str(1 + rng.random() + 1e-6), "must be in (0, 1]"),
        ("--temperature", str(-rng.random() - 1e-6), "must be a finite number >= 0"),
        ("--seed", str(-rng.randrange(1, 1 << 70)), f"must be in [0, {(1 << 64) - 1}]"),
    ]
    for flag, value, message in cases:
        argv = ["--model", str(tiny_model), "--tokens", "1,2", "--temperature", "1", flag, value]
        rc, out, err = run_cli(capsys, "complete", *argv)
        assert (rc, out) == (2, "") and err.startswith(f"colibri complete: error: {flag}: {message}, got "), err


def test_complete_refuses_a_top_k_past_the_vocabulary_and_a_seed_past_uint64(tiny_model, capsys):
    """Both were taken: a top-k over the vocabulary as "off" (the router's API refuses it), a seed over 2^64 - 1
    as a seed the router's uint64 field cannot carry."""
    argv = ["complete", "--model", str(tiny_model), "--tokens", "1,2", "--max-new-tokens", "1", "--temperature", "1"]
    top_k = VOCAB_SIZE + random.randrange(1, 1 << 40)
    rc, out, err = run_cli(capsys, *argv, "--top-k", str(top_k))
    assert (rc, out, err) == (
        2,
        "",
        f"colibri complete: error: --top-k: must be <= the vocabulary size ({VOCAB_SIZE}; 0 = off), got {top_k}\n",
    )
    seed = (1 << 64) + random.randrange(1 << 80)
    rc, out, err = run_cli(capsys, *argv, "--seed", str(seed))
    assert (rc, out, err) == (2, "", f"colibri complete: error: --seed: must be in [0, {(1 << 64) - 1}], got {seed}\n")
    rc, out, _ = run_cli(capsys, *argv, "--top-k", str(VOCAB_SIZE), "--seed", str((1 << 64) - 1))
    assert rc == 0 and json.loads(out)["seed"] == (1 << 64) - 1


# --- a broken tokenizer ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["complete", "router-gen"])
def test_a_tokenizer_the_library_cannot_read_is_one_line_naming_it(tiny_model, tmp_path, capsys, command):
    """complete generated the whole completion, then lost it to a bare Exception's traceback while decoding it."""
    broken = Path(shutil.copytree(tiny_model, tmp_path / "model", ignore=shutil.ignore_patterns("hf")))
    (broken / "tokenizer.json").write_bytes(os.urandom(int(np.random.default_rng().integers(1, 64))) + b"{")
    (tmp_path / "corpus.txt").write_text("some text to route\n")
    argv = (
        ["--model", str(broken), "--tokens", "1,2", "--max-new-tokens", "4"]
        if command == "complete"
        else [str(broken), "--corpus", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "t.bin")]
    )
    rc, out, err = run_cli(capsys, command, *argv, "--no-progress" if command == "router-gen" else "--ignore-eos")
    assert (rc, out) == (3, ""), (rc, out, err)
    assert err.startswith(f"colibri {command}: error: {broken / 'tokenizer.json'}: not a valid tokenizer.json (")
    assert err.count("\n") == 1, err


# --- token id lists ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["logits", "complete"])
@pytest.mark.parametrize("tokens", ["١,٢", "1_0", "1,,2", "+-3", "٣"])
def test_token_ids_that_are_no_comma_separated_decimals_are_refused(tiny_model, tmp_path, capsys, command, tokens):
    """Python's int() read other scripts' digits (١ as 1) and underscores (1_0 as 10) as ids, and an empty item
    (1,,2) was dropped without a word: the model ran on a prompt other than the one typed."""
    rest = ["--out", str(tmp_path / "l.npy")] if command == "logits" else ["--max-new-tokens", "1"]
    rc, out, err = run_cli(capsys, command, "--model", str(tiny_model), "--tokens", tokens, *rest)
    assert (rc, out) == (2, "") and err.count("\n") == 1, (rc, out, err)
    assert err.startswith(f"colibri {command}: error: --tokens: "), err
    assert not (tmp_path / "l.npy").exists()
