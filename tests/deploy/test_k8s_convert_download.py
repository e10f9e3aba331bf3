"""The convert Job's download: which `hf download` errors fail the Job at once (no retry can pass them: a wrong
HF_REPO or HF_REVISION, a token missing, refused or without access) and which are retried (the network, a 5xx, a
rate limit), from hf's messages as huggingface_hub's CLI writes them; and an earlier download hf falls back to
when the Hub cannot be reached, which must not be converted as if it were HF_REPO at HF_REVISION."""

from __future__ import annotations

import os
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.deploy.k8s import find_tool
from tests.deploy.test_k8s_convert import _job, failure_action
from tests.deploy.test_k8s_scripts import _calls, _idempotence_setup, _run_script, _tree

# What `hf download` (huggingface_hub 2.4, the image's) writes to stderr before its exit 1, colours included.
RED, GREY, RESET = "\x1b[1m\x1b[31m", "\x1b[90m", "\x1b[0m"
HINT = f"{GREY}Hint: set HF_DEBUG=1 as environment variable for full traceback.{RESET}"
URL = "https://huggingface.co/api/models/org/model/revision/main"
NOT_FOUND = (
    "Error: Model 'org/model' not found.\nIf the repo is private, make sure you are authenticated and your token "
    "has the required permissions.\nIf the repo does not exist, create it with: hf repos create org/model"
)
PERMANENT = {
    "no such repository, or no token for a private one": (NOT_FOUND, "no such repository"),
    "gated, access not granted": ("Error: Access denied. Model 'org/model' requires approval.", "gated"),
    "no such revision": ("Error: Revision not found in model 'org/model'.", "HF_REVISION is not a branch"),
    "a token the Hub refuses": (
        f"Error: Client error '401 Unauthorized' for url '{URL}'\nFor more information check: "
        "https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/401\n\nInvalid credentials in Authorization header",
        "the Hub refused the token",
    ),
    "a token without access": (
        f"Error: Local entry not found. 403 Forbidden: Your token does not have access.\nCannot access content at: "
        f"{URL}.\nMake sure your token has the correct permissions.",
        "the token may not read the repository",
    ),
    "not a repository id": (
        "Error: Invalid value. Repo id must be in the form 'repo_name' or 'namespace/repo_name': 'org/model/x'. "
        "Use `repo_type` argument if needed.",
        "HF_REPO is not a repository id",
    ),
}
TRANSIENT = {
    "a 500": f"Error: Local entry not found. Server error '500 Internal Server Error' for url '{URL}'",
    "a 503 while downloading a file": f"Error: Server error '503 Service Unavailable' for url '{URL}'",
    "a rate limit": f"Error: Local entry not found. 429 Too Many Requests for url: {URL}.",
    "no connection": "Error: Local entry not found. [Errno 111] Connection refused",
    "a timeout": "Error: Local entry not found. The read operation timed out",
    "a file's storage URL that expired": (
        "Error: \n\n403 Forbidden: None.\nCannot access content at: https://cas-bridge.xethub.hf.co/xet-bridge-us/"
        "abc/def?X-Amz-Expires=3600.\nMake sure your token has the correct permissions."
    ),
}
# What it writes when HF_DIR already holds files and the Hub answers with an error: a warning, then exit 0.
FALLBACK = "Returning existing local_dir `{hf_dir}` as remote repo cannot be accessed in `snapshot_download` ({cause})."
FALLBACK_CAUSES = {
    "no such repository": ("404 Client Error.\n\nRepository Not Found for url: " + URL + ".", 2),
    "gated": ("403 Client Error.\n\nCannot access gated repo for url " + URL + ".\nAccess is restricted", 2),
    "a 500": (f"Server error '500 Internal Server Error' for url '{URL}'", 1),
}

FAKE_HF = """#!/bin/sh
printf '%s\\n' hf "$@" "" >> "$FAKE_LOG"
printf '%s\\n' "$FAKE_HF_STDERR" >&2
exit "${FAKE_HF_EXIT:-0}"
"""


def _setup(renderings, tmp_path):
    script, env, bin_dir, log, model = _idempotence_setup(renderings, tmp_path)
    (bin_dir / "hf").write_text(FAKE_HF)
    revision = random.choice(["", "main", "0123456789abcdef0123456789abcdef01234567"])
    return script, {**env, "HF_REPO": "org/model", "HF_REVISION": revision}, bin_dir, log, model


def _the_line(run, env) -> str:
    """The one line the Job's script wrote of the download (hf's own output stays in the log above it)."""
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("cannot download ")]
    revision = env["HF_REVISION"]
    expected = f"cannot download HF_REPO 'org/model', HF_REVISION '{revision}'"
    assert line.startswith(expected + ("" if revision else " (the default branch)") + ": "), line
    return line


@pytest.mark.parametrize("case", PERMANENT)
def test_a_download_no_retry_can_pass_fails_the_job_at_once(renderings, tmp_path, case):
    job = _job(renderings)
    script, env, bin_dir, log, model = _setup(renderings, tmp_path)
    assert _run_script(script, {**env, "CORPUS": ""}, bin_dir).returncode == 0
    model.with_name("model.old").mkdir()
    before = _tree(model.parent)
    message, cause = PERMANENT[case]
    log.unlink()
    run = _run_script(script, {**env, "FAKE_HF_STDERR": f"{RED}{message}{RESET}\n{HINT}", "FAKE_HF_EXIT": "1"}, bin_dir)
    assert failure_action(job, run.returncode) == "FailJob", f"exit {run.returncode}: {run.stderr}"
    assert cause in _the_line(run, env) and "not retried" in _the_line(run, env)
    assert message.splitlines()[0] in run.stderr, "hf's own message is in the log"
    assert [c[0] for c in _calls(log)] == ["hf"] and _tree(model.parent) == before


@pytest.mark.parametrize("case", TRANSIENT)
def test_a_download_error_that_may_pass_is_retried(renderings, tmp_path, case):
    job = _job(renderings)
    script, env, bin_dir, log, model = _setup(renderings, tmp_path)
    run = _run_script(script, {**env, "FAKE_HF_STDERR": f"{RED}{TRANSIENT[case]}{RESET}", "FAKE_HF_EXIT": "1"}, bin_dir)
    assert run.returncode == 1 and failure_action(job, run.returncode) == "Count", run.stderr
    assert "cannot download" not in run.stderr and TRANSIENT[case] in run.stderr
    assert [c[0] for c in _calls(log)] == ["hf"]


@pytest.mark.parametrize("case", FALLBACK_CAUSES)
def test_an_earlier_download_is_not_converted_as_another(renderings, tmp_path, case):
    """hf exits 0 over an error when HF_DIR holds files: the checkpoint there may not be HF_REPO at HF_REVISION (a
    branch moved on, a download stopped midway) and must not be converted and recorded as it. A cause no retry can pass fails the Job at
    once; one that may pass is retried, unless the model in place was made from these very inputs."""
    job = _job(renderings)
    script, env, bin_dir, log, model = _setup(renderings, tmp_path)
    assert _run_script(script, env, bin_dir).returncode == 0
    cause, code = FALLBACK_CAUSES[case]
    warning = {"FAKE_HF_STDERR": FALLBACK.format(hf_dir=env["HF_DIR"], cause=cause)}
    model.with_name("model.old").mkdir()
    before = _tree(model.parent)
    log.unlink()
    changed = {**env, **warning, "DTYPE": "float16"}  # the checkpoint HF_DIR holds may be another one by now
    run = _run_script(script, changed, bin_dir)
    assert run.returncode == code, run.stdout + run.stderr
    assert failure_action(job, code) == ("FailJob" if code == 2 else "Count")
    line = _the_line(run, env)
    assert ("not retried" in line) == (code == 2), line
    assert [c[0] for c in _calls(log)] == ["hf"] and _tree(model.parent) == before, "nothing converted or deleted"
    # The same inputs as the model in place: the Hub out of reach changes nothing, there is nothing to do.
    same = _run_script(script, {**env, **warning}, bin_dir)
    assert same.returncode == (0 if code == 1 else 2), same.stdout + same.stderr
    assert _tree(model.parent) == before


class _Hub(BaseHTTPRequestHandler):
    """The Hub's API as it answers each error (status, X-Error-Code, X-Error-Message)."""

    answers = {
        "repository": (404, "RepoNotFound", "Repository not found"),
        "gated": (403, "GatedRepo", "Access to model org/model is restricted"),
        "token": (401, None, "Invalid credentials in Authorization header"),
        "revision": (404, "RevisionNotFound", "Invalid rev id: nope"),
        "5xx": (503, None, None),
    }

    def do_GET(self):  # noqa: N802 (the handler's name)
        status, code, message = self.answers[self.server.answer]
        self.send_response(status)
        for header, value in (("X-Error-Code", code), ("X-Error-Message", message)):
            if value:
                self.send_header(header, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_real_hf_download_errors_are_told_apart(renderings, tmp_path):
    """The image's `hf` against a stand-in Hub on loopback: its real messages give the codes the policy reads."""
    hf = find_tool("hf")
    if hf is None:
        pytest.skip("huggingface_hub's `hf` is not installed")
    job = _job(renderings)
    script, env, bin_dir, log, model = _setup(renderings, tmp_path)
    (bin_dir / "hf").unlink()
    (bin_dir / "hf").symlink_to(hf)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {
        **env,
        "HF_DIR": str(tmp_path / "download"),
        "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_TOKEN": "hf_" + "x" * 34,
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_ETAG_TIMEOUT": "5",
    }
    try:
        for answer, action in [("repository", "FailJob"), ("gated", "FailJob"), ("token", "FailJob"),
                               ("revision", "FailJob"), ("5xx", "Count")]:  # fmt: skip
            server.answer = answer
            run = _run_script(script, env, bin_dir)
            assert failure_action(job, run.returncode) == action, f"{answer}: exit {run.returncode}\n{run.stderr}"
            assert ("cannot download" in run.stderr) == (action == "FailJob"), f"{answer}: {run.stderr}"
            assert not os.path.exists(model), answer
    finally:
        server.shutdown()
        server.server_close()
    assert not Path(env["HF_DIR"], "config.json").exists()


# A stand-in for `hf download` that writes the files $FAKE_HF_FILES names (name=content, one a line) into its
# --local-dir, overwriting those that differ, never removing any, as hf does.
FAKE_HF_WRITING = """#!/bin/sh
printf '%s\\n' hf "$@" "" >> "$FAKE_LOG"
while [ "$#" -gt 0 ]; do [ "$1" = --local-dir ] && dir=$2; shift; done
mkdir -p "$dir"
printf '%s\\n' "$FAKE_HF_FILES" | while IFS='=' read -r name content; do
  [ "$(cat "$dir/$name" 2>/dev/null)" = "$content" ] || printf '%s' "$content" > "$dir/$name"
done
"""
REPOSITORIES = {
    "org/a": {
        "config.json": '{"model_type": "mixtral"}',
        "model.safetensors.index.json": '{"weight_map": {}}',
        "model-00001-of-00002.safetensors": "a1",
        "model-00002-of-00002.safetensors": "a2",
        "chat_template.jinja": "a's template",
        "generation_config.json": "{}",
    },
    "org/b": {"config.json": '{"model_type": "qwen3_moe"}', "model.safetensors": "b", "tokenizer.json": "{}"},
}


def test_a_download_of_another_repository_leaves_none_of_the_last_ones_files(renderings, tmp_path):
    """HF_REPO (or HF_REVISION) changed: the files of the earlier download that the new one lacks (its shards and
    index, its chat template, its generation config) are not left in HF_DIR to be converted as the new model's.
    Files not downloaded by the Job (a checkpoint put there by hand, no download recorded) are left alone."""
    script, env, bin_dir, log, model = _setup(renderings, tmp_path)
    (bin_dir / "hf").write_text(FAKE_HF_WRITING)
    hf_dir = Path(tmp_path / "download")
    hf_dir.mkdir()
    (hf_dir / "notes.txt").write_text("the operator's")

    def download(repo: str, revision: str = "") -> set[str]:
        files = "\n".join(f"{k}={v}" for k, v in REPOSITORIES[repo].items())
        run = _run_script(
            script,
            {**env, "HF_DIR": str(hf_dir), "HF_REPO": repo, "HF_REVISION": revision, "FAKE_HF_FILES": files},
            bin_dir,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        return {p.name for p in hf_dir.iterdir() if not p.name.startswith(".")}

    (hf_dir / "by-hand.safetensors").write_text("put there before the first download")
    assert download("org/a") == {*REPOSITORIES["org/a"], "notes.txt", "by-hand.safetensors"}
    assert download("org/b") == {*REPOSITORIES["org/b"], "notes.txt"}
    converted_from = (model / ".colibri-convert-inputs").read_text()
    assert "HF_REPO=org/b\n" in converted_from and "./model.safetensors " in converted_from
    assert "./chat_template.jinja" not in converted_from and "./model-00001" not in converted_from
    # The same repository again: nothing removed, nothing to do.
    before = _tree(hf_dir)
    log.unlink()
    assert download("org/b") == {*REPOSITORIES["org/b"], "notes.txt"}
    assert [c[0] for c in _calls(log)] == ["hf"] and _tree(hf_dir).keys() == before.keys()
    # Another revision of it: a fresh download too.
    (hf_dir / "model-00009-of-00009.safetensors").write_text("of an older revision")
    assert download("org/b", random.choice(["v2", "0123abc"])) == {*REPOSITORIES["org/b"], "notes.txt"}
