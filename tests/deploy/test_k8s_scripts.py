"""The shell scripts embedded in the manifests, run as written (paths mapped into a temp dir): the convert
Job on the tiny model, and the server pod's `prepare` init container."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.deploy.k8s import container, find_tool, pod_spec


def _colibri_bin() -> Path:
    colibri = find_tool("colibri")
    if colibri is None:
        pytest.skip("the colibri command is not installed")
    return Path(colibri).parent


def _run_script(script: str, env: dict[str, str], bin_dir: Path) -> subprocess.CompletedProcess:
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": env.get("HOME", "/tmp"), **env}
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=300)


def test_convert_job_script(renderings, tmp_path):
    bin_dir = _colibri_bin()
    r = renderings["convert"]
    (c,) = pod_spec(r.one("Job", "colibri-convert"))["containers"]
    assert c["command"] == ["/bin/sh", "-c"]
    script = c["args"][0]
    settings = r.one("ConfigMap", c["envFrom"][0]["configMapRef"]["name"])["data"]
    assert set(settings) == {"HF_DIR", "HF_REPO", "MODEL_DIR", "DTYPE", "CORPUS"}

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
    # A failing conversion leaves the served model untouched.
    bad = _run_script(script, {**env, "HF_DIR": str(tmp_path / "missing")}, bin_dir)
    assert bad.returncode != 0
    assert (model / "colibri.json").is_file()


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
