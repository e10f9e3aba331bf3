"""The shell scripts embedded in the manifests, run as written (paths mapped into a temp dir): the convert
Job on the tiny model, and the server pod's `prepare` init container."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from expert_service.tools.convert import TOKENIZER_FILES
from tests.deploy.k8s import REPO, container, find_tool, pod_spec


def _colibri_bin() -> Path:
    colibri = find_tool("colibri")
    if colibri is None:
        pytest.skip("the colibri command is not installed")
    return Path(colibri).parent


def _run_script(
    script: str, env: dict[str, str], bin_dir: Path, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    # PYTHONPATH: the colibri of this checkout, also where the venv's is an editable install of another one.
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": env.get("HOME", "/tmp"),
        "PYTHONPATH": str(REPO),
        **env,
    }
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=300, cwd=cwd)


# A stand-in for the image's `colibri`: logs each call's arguments (one per line, a blank line after each call) to
# $FAKE_LOG and makes what each step makes, so that the script's own logic runs in milliseconds.
FAKE_COLIBRI = """#!/bin/sh
for a in "$@"; do printf '%s\\n' "$a"; done >> "$FAKE_LOG"
echo >> "$FAKE_LOG"
case "$1" in
  convert) [ -f "$2/config.json" ] || { echo "colibri convert: error: no config.json in $2" >&2; exit 3; }
           if [ -n "${FAKE_CONVERT_SLEEP:-}" ]; then echo $$ > "$FAKE_LOG.pid"; exec sleep "$FAKE_CONVERT_SLEEP"; fi
           [ -z "${FAKE_CONVERT_EXIT:-}" ] || exit "$FAKE_CONVERT_EXIT"
           mkdir -p "$3" && echo '{}' > "$3/colibri.json" && echo "$*" > "$3/made-by" ;;
  router-gen) touch "$2/routing_table.bin" ;;
  verify) [ -f "$2/colibri.json" ] ;;
  *) echo "usage: colibri [-h] SUBCOMMAND ..." >&2; exit 2 ;;
esac
"""


def _fake_colibri(tmp_path: Path) -> tuple[Path, Path]:
    """(a bin folder holding the fake `colibri`, the file its calls are logged to)."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    fake = bin_dir / "colibri"
    fake.write_text(FAKE_COLIBRI)
    fake.chmod(0o755)
    return bin_dir, tmp_path / "colibri-calls.log"


def _calls(log: Path) -> list[list[str]]:
    """The fake colibri's calls, each its argument list."""
    if not log.exists():
        return []
    return [call.split("\n") for call in log.read_text().split("\n\n") if call]


def _job(renderings) -> tuple[str, dict[str, str]]:
    """(the convert Job's script, its settings as the ConfigMap renders them)."""
    r = renderings["convert"]
    (c,) = pod_spec(r.one("Job", "colibri-convert"))["containers"]
    assert c["command"] == ["/bin/sh", "-c"]
    return c["args"][0], r.one("ConfigMap", c["envFrom"][0]["configMapRef"]["name"])["data"]


def _checkpoint(tmp_path: Path) -> Path:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "mixtral"}')
    (hf / "model.safetensors").write_bytes(b"\0" * 64)
    return hf


def test_convert_job_script(renderings, tmp_path):
    bin_dir = _colibri_bin()
    r = renderings["convert"]
    (c,) = pod_spec(r.one("Job", "colibri-convert"))["containers"]
    assert c["command"] == ["/bin/sh", "-c"]
    script = c["args"][0]
    settings = r.one("ConfigMap", c["envFrom"][0]["configMapRef"]["name"])["data"]
    assert set(settings) == {
        "HF_DIR",
        "HF_REPO",
        "HF_REVISION",
        "MODEL_DIR",
        "DTYPE",
        "EXPERT_DTYPE",
        "FP8_SCALE",
        "HEAD_DTYPE",
        "EXPERT_DTYPE_FILE",
        "CORPUS",
        "FORCE",
    }

    tiny = tmp_path / "tiny"
    made = subprocess.run(
        [bin_dir / "colibri", "make-tiny", str(tiny), "--no-progress"], capture_output=True, text=True, timeout=300
    )
    assert made.returncode == 0, made.stderr
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The capital of France is Paris.\nExperts route tokens.\n" * 4)
    model = tmp_path / "models" / "model"
    env = {**settings, "HF_DIR": str(tiny / "hf"), "MODEL_DIR": str(model), "CORPUS": str(corpus)}
    assert env["HF_REPO"] == "", "the default converts what is on the volume (no download)"

    first = _run_script(script, env, bin_dir)
    assert first.returncode == 0, first.stdout + first.stderr
    assert {"colibri.json", "routing_table.bin", "tokenizer.json"} <= {p.name for p in model.iterdir()}
    assert f"model ready at {model}" in first.stdout
    assert sorted(p.name for p in model.parent.iterdir()) == ["model"], "no .partial left behind"
    # Converting again (keeping the checkpoint's dtype, no corpus) replaces the model as a whole. The replaced one
    # stays beside it: replicas on other nodes still map its files until they are restarted, and on NFS a file one
    # client deletes is gone for every other client that has it open (their next page-in is a SIGBUS).
    second = _run_script(script, {**env, "DTYPE": "", "CORPUS": ""}, bin_dir)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "routing_table.bin" not in {p.name for p in model.iterdir()}
    old = model.with_name("model.old")
    assert sorted(p.name for p in model.parent.iterdir()) == ["model", "model.old"], (
        "the replaced model is kept as model.old, and no .partial is left behind"
    )
    assert "routing_table.bin" in {p.name for p in old.iterdir()}, "model.old is the model the servers ran"
    # The next conversion (after the restart the docs ask for) removes it first.
    third = _run_script(script, {**env, "CORPUS": ""}, bin_dir)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "routing_table.bin" not in {p.name for p in old.iterdir()}, "the model of two conversions ago is gone"
    # The same inputs again: nothing to do, the model and model.old are left as they are.
    before = {p: p.stat().st_mtime_ns for p in model.parent.rglob("*")}
    fourth = _run_script(script, {**env, "CORPUS": ""}, bin_dir)
    assert fourth.returncode == 0, fourth.stdout + fourth.stderr
    assert f"model at {model} is already converted from these inputs; nothing to do" in fourth.stdout
    assert {p: p.stat().st_mtime_ns for p in model.parent.rglob("*")} == before
    # A failing conversion leaves the served model untouched.
    bad = _run_script(script, {**env, "HF_DIR": str(tmp_path / "missing")}, bin_dir)
    assert bad.returncode != 0
    assert (model / "colibri.json").is_file()


def test_convert_job_passes_the_8bit_settings(renderings, tmp_path):
    """EXPERT_DTYPE, FP8_SCALE and HEAD_DTYPE reach `colibri convert` as its flags when set, and not at all when
    empty (the converter's own defaults), each documented where the operator sets it."""
    script, settings = _job(renderings)
    for key in ("EXPERT_DTYPE", "FP8_SCALE", "HEAD_DTYPE", "EXPERT_DTYPE_FILE"):
        assert settings[key] == "", f"{key}: empty by default (the flag is not passed)"
    kustomization = (REPO / "deploy" / "k8s" / "convert" / "kustomization.yaml").read_text()
    docs = (REPO / "docs" / "deploy.md").read_text()
    for key in settings:
        assert f"| `{key}` |" in docs, f"docs/deploy.md: {key} is not in the convert Job's settings table"
        assert re.search(rf"#[^\n]*\n\s+- {key}=", kustomization), f"the kustomization does not explain {key}"
    bin_dir, log = _fake_colibri(tmp_path)
    env = {**settings, "HF_DIR": str(_checkpoint(tmp_path)), "MODEL_DIR": str(tmp_path / "models" / "model")}
    env["FAKE_LOG"] = str(log)

    run = _run_script(script, env, bin_dir)
    assert run.returncode == 0, run.stdout + run.stderr
    (convert,) = [c for c in _calls(log) if c[0] == "convert"]
    assert not [a for a in convert if a.startswith(("--expert-dtype", "--fp8-scale", "--head-dtype"))], convert

    log.unlink()
    dtype_file = tmp_path / "expert dtypes.yaml"  # a space: still one argument
    dtype_file.write_text("default: int8\n")
    eight_bit = {"DTYPE": "bf16", "EXPERT_DTYPE": "fp8", "FP8_SCALE": "channel", "HEAD_DTYPE": "int8"}
    run = _run_script(script, {**env, **eight_bit, "EXPERT_DTYPE_FILE": str(dtype_file)}, bin_dir)
    assert run.returncode == 0, run.stdout + run.stderr
    (convert,) = [c for c in _calls(log) if c[0] == "convert"]
    for flag in ("--dtype=bf16", "--expert-dtype=fp8", "--fp8-scale=channel", "--head-dtype=int8"):
        assert flag in convert, convert
    assert f"--expert-dtype-file={dtype_file}" in convert, convert
    assert f"EXPERT_DTYPE_FILE={dtype_file}\n" in (Path(env["MODEL_DIR"]) / ".colibri-convert-inputs").read_text()

    # A path that is not a file is refused before anything is touched, with the code that fails the Job at once.
    before = _tree(Path(env["MODEL_DIR"]).parent)
    log.unlink()
    missing = _run_script(script, {**env, "EXPERT_DTYPE_FILE": str(tmp_path / "nope.yaml")}, bin_dir)
    assert missing.returncode == 2 and "EXPERT_DTYPE_FILE is '" in missing.stderr, missing.stderr
    assert not log.exists() and _tree(Path(env["MODEL_DIR"]).parent) == before


def test_convert_job_quotes_the_settings(renderings, tmp_path):
    """A value with spaces, globs or shell syntax is one argument of `colibri convert`, as written: not split into
    several flags, not expanded, not run."""
    script, settings = _job(renderings)
    bin_dir, log = _fake_colibri(tmp_path)
    work = tmp_path / "cwd"
    work.mkdir()
    (work / "a-file").touch()  # what an unquoted * would expand to
    hostile = {
        "DTYPE": "bfloat16 --head-dtype fp8",
        "EXPERT_DTYPE": "int8 $(touch pwned) `touch pwned2`",
        "FP8_SCALE": "*",
        "HEAD_DTYPE": "fp8; touch pwned3",
    }
    env = {**settings, **hostile, "HF_DIR": str(_checkpoint(tmp_path)), "MODEL_DIR": str(tmp_path / "m" / "model")}
    run = _run_script(script, {**env, "FAKE_LOG": str(log)}, bin_dir, cwd=work)
    assert run.returncode == 0, run.stdout + run.stderr
    (convert,) = [c for c in _calls(log) if c[0] == "convert"]
    assert convert[3:] == [
        "--dtype=bfloat16 --head-dtype fp8",
        "--expert-dtype=int8 $(touch pwned) `touch pwned2`",
        "--fp8-scale=*",
        "--head-dtype=fp8; touch pwned3",
        "--no-progress",
    ]
    assert sorted(p.name for p in work.iterdir()) == ["a-file"], "a value was run by the shell"


def test_convert_job_converts_an_8bit_model(renderings, tmp_path):
    """The real converter, as the Job calls it: int8 experts and an int8 head from the settings."""
    bin_dir = _colibri_bin()
    script, settings = _job(renderings)
    tiny = tmp_path / "tiny"
    made = subprocess.run(
        [bin_dir / "colibri", "make-tiny", str(tiny), "--no-progress"], capture_output=True, text=True, timeout=300
    )
    assert made.returncode == 0, made.stderr
    model = tmp_path / "models" / "model"
    env = {**settings, "HF_DIR": str(tiny / "hf"), "MODEL_DIR": str(model), "EXPERT_DTYPE": "int8"}
    run = _run_script(script, {**env, "HEAD_DTYPE": "int8"}, bin_dir)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "experts int8, head int8" in run.stdout, run.stdout
    manifest = json.loads((model / "colibri.json").read_text())
    assert "int8" in {t["dtype"] for t in manifest["tensors"].values()}
    # The experts' dtype from a file (the flag as the real parser spells it).
    dtype_file = tmp_path / "expert-dtypes.yaml"
    dtype_file.write_text("default: int8\n")
    run = _run_script(script, {**env, "EXPERT_DTYPE": "", "EXPERT_DTYPE_FILE": str(dtype_file)}, bin_dir)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "experts int8" in run.stdout, run.stdout


# A stand-in for `hf download`: a checkpoint in its --local-dir when none is there (hf leaves files that are up to
# date as they are).
FAKE_HF = """#!/bin/sh
printf '%s\\n' hf "$@" "" >> "$FAKE_LOG"
while [ "$#" -gt 0 ]; do [ "$1" = --local-dir ] && dir=$2; shift; done
mkdir -p "$dir" && [ -f "$dir/config.json" ] || echo '{"model_type": "mixtral"}' > "$dir/config.json"
exit "${FAKE_HF_EXIT:-0}"
"""


def _idempotence_setup(renderings, tmp_path: Path) -> tuple[str, dict[str, str], Path, Path, Path]:
    """(script, env, bin folder, call log, MODEL_DIR) for the fake colibri, with a corpus and a fake `hf`."""
    script, settings = _job(renderings)
    bin_dir, log = _fake_colibri(tmp_path)
    (bin_dir / "hf").write_text(FAKE_HF)
    (bin_dir / "hf").chmod(0o755)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some traffic\n")
    model = tmp_path / "models" / "model"
    env = {**settings, "HF_DIR": str(_checkpoint(tmp_path)), "MODEL_DIR": str(model), "CORPUS": str(corpus)}
    return script, {**env, "FAKE_LOG": str(log)}, bin_dir, log, model


def _tree(directory: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file and folder under `directory`: (inode, mtime, content)."""
    return {
        str(p.relative_to(directory)): (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
        for p in directory.rglob("*")
    }


def test_convert_job_applied_again_converts_nothing(renderings, tmp_path):
    """A Job applied again with the same inputs (GitOps re-creating it after ttlSecondsAfterFinished removed it, an
    apply after a delete) converts nothing: it neither replaces the model with the same bytes (a restart of every
    replica for nothing) nor deletes MODEL_DIR.old, which replicas not restarted since still read (on NFS: ESTALE,
    SIGBUS)."""
    script, env, bin_dir, log, model = _idempotence_setup(renderings, tmp_path)
    first = _run_script(script, env, bin_dir)
    assert first.returncode == 0, first.stdout + first.stderr
    assert [c[0] for c in _calls(log)] == ["convert", "router-gen", "verify"]
    stamp = (model / ".colibri-convert-inputs").read_text()
    assert f"DTYPE={env['DTYPE']}\n" in stamp and f"CORPUS={env['CORPUS']}\n" in stamp
    old = model.with_name("model.old")  # the model that conversion replaced, still mapped by some replicas
    old.mkdir()
    (old / "colibri.json").write_text("{}")
    before = _tree(model.parent)

    log.unlink()
    again = _run_script(script, env, bin_dir)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"model at {model} is already converted from these inputs; nothing to do" in again.stdout
    assert _calls(log) == [], "nothing is converted"
    assert _tree(model.parent) == before, "MODEL_DIR and MODEL_DIR.old are left exactly as they were"

    # HF_REPO set: the download runs (it fetches only what changed), then the same checkpoint converts nothing.
    with_repo = {**env, "HF_REPO": "org/model"}
    assert _run_script(script, with_repo, bin_dir).returncode == 0
    log.unlink()
    again = _run_script(script, with_repo, bin_dir)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr
    assert [c[0] for c in _calls(log)] == ["hf"]


def test_convert_job_downloads_only_what_the_converter_reads(renderings, tmp_path):
    """With HF_REPO the Job downloads the safetensors, config and tokenizer files, not the copies of the weights in
    other formats that some repositories also hold (Mixtral's consolidated.*.pt, pytorch_model*.bin): those would
    double the download and can fill the volume before the model is written."""
    script, env, bin_dir, log, model = _idempotence_setup(renderings, tmp_path)
    run = _run_script(script, {**env, "HF_REPO": "org/model"}, bin_dir)
    assert run.returncode == 0, run.stdout + run.stderr
    (download,) = [c for c in _calls(log) if c[0] == "hf"]
    assert download[1:5] == ["download", "org/model", "--local-dir", env["HF_DIR"]], download
    assert env["HF_REVISION"] == "" and not [a for a in download if a.startswith("--revision")]
    patterns = [download[i + 1] for i, a in enumerate(download) if a == "--include"]
    wanted = ["config.json", "model.safetensors", "model-00001-of-00019.safetensors", "model.safetensors.index.json"]
    for name in (*wanted, *TOKENIZER_FILES):
        assert any(fnmatch.fnmatch(name, p) for p in patterns), f"{name} is not downloaded ({patterns})"
    for name in ("consolidated.00.pt", "pytorch_model-00001-of-00019.bin", "pytorch_model.bin", "model.pth"):
        assert not any(fnmatch.fnmatch(name, p) for p in patterns), f"{name} is downloaded ({patterns})"


def test_convert_job_downloads_the_revision_it_is_given(renderings, tmp_path):
    """HF_REVISION pins the checkpoint (`hf download --revision`, one argument whatever it holds): without it a Job
    applied again after a push to the repository's default branch converts another checkpoint than the one served."""
    script, env, bin_dir, log, model = _idempotence_setup(renderings, tmp_path)
    for revision in ("0123456789abcdef0123456789abcdef01234567", "v1.0 $(touch pwned) *"):
        log.unlink(missing_ok=True)
        run = _run_script(script, {**env, "HF_REPO": "org/model", "HF_REVISION": revision}, bin_dir, cwd=tmp_path)
        assert run.returncode == 0, run.stdout + run.stderr
        (download,) = [c for c in _calls(log) if c[0] == "hf"]
        assert download[1:4] == ["download", "org/model", f"--revision={revision}"], download
        assert f"HF_REVISION={revision}\n" in (model / ".colibri-convert-inputs").read_text()
    assert not (tmp_path / "pwned").exists()


def _change_dtype(env, tmp_path):
    return {**env, "DTYPE": "float16"}


def _touch_shard(env, tmp_path):
    shard = Path(env["HF_DIR"]) / "model.safetensors"
    os.utime(shard, (shard.stat().st_atime, shard.stat().st_mtime + 10))
    return env


def _add_shard(env, tmp_path):
    (Path(env["HF_DIR"]) / "model-00002-of-00002.safetensors").write_bytes(b"\0")
    return env


def _edit_config(env, tmp_path):
    config = Path(env["HF_DIR"]) / "config.json"
    mtime = config.stat().st_mtime_ns
    config.write_text(config.read_text().replace("mixtral", "mixtraL"))  # same size, same mtime
    os.utime(config, ns=(mtime, mtime))
    return env


def _grow_corpus(env, tmp_path):
    with open(env["CORPUS"], "a") as f:
        f.write("more traffic\n")
    return env


def _add_dtype_file(env, tmp_path):
    (tmp_path / "expert-dtypes.yaml").write_text("default: int8\n")
    return {**env, "EXPERT_DTYPE_FILE": str(tmp_path / "expert-dtypes.yaml")}


def _edit_dtype_file(env, tmp_path):
    """The file the model was converted with, given other content of the same size and mtime."""
    dtype_file = Path(env["EXPERT_DTYPE_FILE"])
    mtime = dtype_file.stat().st_mtime_ns
    dtype_file.write_text("default: fp8\n\n")
    os.utime(dtype_file, ns=(mtime, mtime))
    return env


CHANGES = {
    "DTYPE": _change_dtype,
    "EXPERT_DTYPE": lambda env, tmp_path: {**env, "EXPERT_DTYPE": "int8"},
    "FP8_SCALE": lambda env, tmp_path: {**env, "EXPERT_DTYPE": "fp8", "FP8_SCALE": "channel"},
    "HEAD_DTYPE": lambda env, tmp_path: {**env, "HEAD_DTYPE": "int8"},
    "HF_REPO": lambda env, tmp_path: {**env, "HF_REPO": "org/model"},
    "HF_REVISION": lambda env, tmp_path: {**env, "HF_REPO": "org/model", "HF_REVISION": "0123abc"},
    "CORPUS": lambda env, tmp_path: {**env, "CORPUS": ""},
    "EXPERT_DTYPE_FILE": _add_dtype_file,
    "the expert dtype file's content": _edit_dtype_file,
    "corpus file": _grow_corpus,
    "a shard's mtime": _touch_shard,
    "a new shard": _add_shard,
    "config.json's content": _edit_config,
    "FORCE=1": lambda env, tmp_path: {**env, "FORCE": "1"},
}


@pytest.mark.parametrize("change", CHANGES)
def test_convert_job_converts_again_when_an_input_changes(renderings, tmp_path, change):
    script, env, bin_dir, log, model = _idempotence_setup(renderings, tmp_path)
    if change == "the expert dtype file's content":
        env = _add_dtype_file(env, tmp_path)
    assert _run_script(script, env, bin_dir).returncode == 0
    (model / "served").touch()
    log.unlink()
    changed = CHANGES[change](env, tmp_path)
    run = _run_script(script, changed, bin_dir)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "convert" in [c[0] for c in _calls(log)], f"{change} changed, and the model was not converted again"
    assert (model.with_name("model.old") / "served").exists(), "the new model is swapped in"
    if change != "FORCE=1":  # the new model records its own inputs: the same Job applied again converts nothing
        assert "nothing to do" in _run_script(script, changed, bin_dir).stdout


def test_convert_job_converts_a_model_without_a_record(renderings, tmp_path):
    """A model converted before the Job recorded its inputs, and a record without a model manifest, are converted
    again; a FORCE that is neither empty nor 1 is refused before anything is touched."""
    script, env, bin_dir, log, model = _idempotence_setup(renderings, tmp_path)
    assert _run_script(script, env, bin_dir).returncode == 0
    (model / ".colibri-convert-inputs").unlink()
    log.unlink()
    assert _run_script(script, env, bin_dir).returncode == 0
    assert "convert" in [c[0] for c in _calls(log)]
    (model / "colibri.json").unlink()
    log.unlink()
    assert _run_script(script, env, bin_dir).returncode == 0
    assert "convert" in [c[0] for c in _calls(log)]

    before = _tree(model.parent)
    bad = _run_script(script, {**env, "FORCE": "yes"}, bin_dir)
    assert bad.returncode == 2 and "FORCE is 'yes'" in bad.stderr, bad.stderr
    assert _tree(model.parent) == before


def test_convert_job_without_a_checkpoint_deletes_nothing(renderings, tmp_path):
    """The checkpoint gone from the volume (deleted to free space after converting): the Job fails in one line
    before it deletes MODEL_DIR.old or touches MODEL_DIR."""
    script, env, bin_dir, log, model = _idempotence_setup(renderings, tmp_path)
    assert _run_script(script, env, bin_dir).returncode == 0
    old = model.with_name("model.old")
    old.mkdir()
    before = _tree(model.parent)
    for p in Path(env["HF_DIR"]).iterdir():
        p.unlink()
    run = _run_script(script, env, bin_dir)
    assert run.returncode == 3
    assert f"no checkpoint at {env['HF_DIR']} (no config.json)" in run.stderr
    assert _tree(model.parent) == before


JOB_UID = 10001


def test_convert_job_says_when_it_cannot_write_the_volume(renderings, tmp_path):
    """A volume the Job's user cannot write (an NFS export owned by root: fsGroup is not applied to NFS) fails in
    one line saying what to do, before anything runs, not with a bare "Permission denied" from rm or mv. Run as
    the Job's uid where the tests run as root (root writes anywhere), else on a read-only folder."""
    script, settings = _job(renderings)
    bin_dir, log = _fake_colibri(tmp_path)
    as_job_user: list[str] = []
    top = Path(tempfile.mkdtemp(prefix="colibri-volume-"))  # not under tmp_path, which only root may enter
    try:
        top.chmod(0o755)
        read_only, writable = top / "read-only", top / "writable"
        read_only.mkdir()
        writable.mkdir()
        if os.geteuid() == 0:
            setpriv = find_tool("setpriv")
            if setpriv is None:
                pytest.skip("running as root without setpriv: cannot run the script as a user the folder refuses")
            as_job_user = [setpriv, f"--reuid={JOB_UID}", f"--regid={JOB_UID}", "--clear-groups"]
            os.chown(writable, JOB_UID, JOB_UID)
        else:
            read_only.chmod(0o555)
        env = {**settings, "HF_DIR": str(top / "missing"), "FAKE_LOG": str(log)}
        env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": "/tmp", **env}

        def run(models: Path) -> subprocess.CompletedProcess:
            command = [*as_job_user, "sh", "-c", script]
            env["MODEL_DIR"] = str(models / "model")
            return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, cwd=top)

        refused = run(read_only)
        uid = JOB_UID if as_job_user else os.geteuid()
        assert refused.returncode == 2
        assert refused.stderr.startswith(f"cannot write {read_only} as uid {uid} gid "), refused.stderr
        assert "make the volume writable by uid/gid 10001 (NFS: chown" in refused.stderr
        assert len(refused.stderr.splitlines()) == 1, refused.stderr
        assert not log.exists(), "nothing ran"
        # MODEL_DIR in a folder still to be made: the folder it will be made in is the one checked.
        refused = run(read_only / "sub")
        assert refused.returncode == 2 and refused.stderr.startswith(f"cannot write {read_only} as"), refused.stderr
        # A writable volume passes the check (and fails at the next one: there is no checkpoint).
        passed = run(writable)
        assert "cannot write" not in passed.stderr and "no checkpoint at" in passed.stderr, passed.stderr
        # So does a volume whose MODEL_DIR.old the Job's user cannot delete.
        old = writable / "model.old"
        old.mkdir()
        if not as_job_user:
            old.chmod(0o555)
        refused = run(writable)
        assert refused.returncode == 2 and refused.stderr.startswith(f"cannot write {old} as uid"), refused.stderr
    finally:
        for p in (top, *top.rglob("*")):
            p.chmod(0o755)
        shutil.rmtree(top)


def test_convert_job_script_recovers_from_a_stop_between_its_renames(renderings, tmp_path):
    """A pod stopped after moving the served model aside and before moving the new one in (evicted, node lost)
    leaves no MODEL_DIR. The Job's next pod must put the served model back, not delete it: if converting again
    fails, the servers would otherwise wait for a model forever."""
    bin_dir = _colibri_bin()
    r = renderings["convert"]
    (c,) = pod_spec(r.one("Job", "colibri-convert"))["containers"]
    settings = r.one("ConfigMap", c["envFrom"][0]["configMapRef"]["name"])["data"]
    model = tmp_path / "models" / "model"
    old = model.with_name("model.old")
    old.mkdir(parents=True)
    (old / "colibri.json").write_text("{}")
    model.with_name("model.partial").mkdir()
    env = {**settings, "HF_DIR": str(tmp_path / "missing"), "MODEL_DIR": str(model), "CORPUS": ""}

    retry = _run_script(c["args"][0], env, bin_dir)
    assert retry.returncode != 0, "nothing to convert: the retry fails"
    assert (model / "colibri.json").is_file(), "the served model was deleted"
    assert not old.exists()


def test_prepare_init_container(renderings, tmp_path):
    bin_dir = _colibri_bin()
    spec = pod_spec(renderings["gpu"].one("Deployment", "colibri"))
    prepare = container(spec, "prepare")
    assert prepare["command"] == ["/bin/sh", "-c"]
    token_file = "/etc/colibri/worker-token/token"
    mapped = {"/models/": f"{tmp_path}/models/", "/etc/colibri/worker-token/": f"{tmp_path}/token/"}
    script = prepare["args"][0]
    for path, local in mapped.items():
        assert path in script
        script = script.replace(path, local)
    (tmp_path / "token").mkdir()
    (tmp_path / "models" / "model").mkdir(parents=True)
    (tmp_path / "models" / "model" / "colibri.json").write_text("{}")

    proc = _run_script(script, {}, bin_dir)
    assert proc.returncode == 0, proc.stderr
    token = tmp_path / "token" / Path(token_file).name
    assert len(token.read_text().strip()) >= 32
    assert stat.S_IMODE(token.stat().st_mode) == 0o600, "only the pod's user may read the token"
    first = token.read_text()
    assert _run_script(script, {}, bin_dir).returncode == 0
    assert token.read_text() != first, "a fresh token per pod start"
