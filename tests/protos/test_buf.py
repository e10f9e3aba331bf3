"""`make lint-proto`'s checks: the protos pass buf's STANDARD lint and break nothing against the committed baseline
(protos/api.binpb), and a copy with a real breaking change (or a lint violation) is caught.

buf comes from `make test` / `make lint-proto` (pinned, npm, into .buf/); without it these tests skip."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTOS = REPO / "protos"
BASELINE = PROTOS / "api.binpb"
ROUTER = "colibri/router/v1/router.proto"
WORKER = "colibri/worker/v1/worker.proto"


def _buf() -> str | None:
    local = REPO / ".buf" / "node_modules" / ".bin" / "buf"
    return str(local) if local.exists() else shutil.which("buf")


BUF = _buf()
pytestmark = pytest.mark.skipif(BUF is None, reason="buf is not installed (`make lint-proto` installs it into .buf/)")


def buf(*args: str) -> tuple[int, list[dict]]:
    """Runs buf with JSON findings; returns its exit code and the findings."""
    done = subprocess.run([BUF, *args, "--error-format=json"], capture_output=True, text=True, timeout=120)
    findings = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 0 or findings, f"buf {' '.join(args)} failed without findings: {done.stderr}"
    return done.returncode, findings


@pytest.fixture
def protos_copy(tmp_path) -> Path:
    copy = tmp_path / "protos"
    shutil.copytree(PROTOS, copy)
    return copy


@pytest.fixture(scope="module")
def current_image(tmp_path_factory) -> Path:
    """The protos as they are now, built: the mutation tests compare against it, so they keep testing the
    check itself while the API grows between baselines."""
    image = tmp_path_factory.mktemp("buf") / "current.binpb"
    code, findings = buf("build", str(PROTOS), "-o", str(image))
    assert code == 0 and image.stat().st_size > 0, findings
    return image


def edit(root: Path, file: str, pattern: str, replacement: str) -> None:
    """Replaces the one match of `pattern` (a missing one fails: the test must not pass on an unchanged copy)."""
    path = root / file
    text, count = re.subn(pattern, replacement, path.read_text(), flags=re.MULTILINE)
    assert count == 1, f"{file}: expected one match of {pattern!r}, got {count}"
    path.write_text(text)


def test_protos_pass_standard_lint():
    assert buf("lint", str(PROTOS)) == (0, [])


def test_protos_break_nothing_against_the_committed_baseline():
    assert BASELINE.is_file(), "protos/api.binpb is missing: run `make proto-baseline` and commit it"
    code, findings = buf("breaking", str(PROTOS), "--against", str(BASELINE))
    assert code == 0, (
        "breaking changes against protos/api.binpb (if deliberate, run `make proto-baseline` and "
        "commit protos/api.binpb; docs/api.md, Changing the API):\n"
        + "\n".join(f"{f['path']}:{f['start_line']}: {f['type']}: {f['message']}" for f in findings)
    )


@pytest.mark.parametrize(
    "file,pattern,replacement,rule,name",
    [
        (ROUTER, r"^ *(optional )?uint32 top_k = 2;\n", "", "FIELD_NO_DELETE", "top_k"),
        (ROUTER, r"rpc Generate\(", "rpc Complete(", "RPC_NO_DELETE", "Generate"),
        (WORKER, r"double warmup_ms = 1;", "float warmup_ms = 1;", "FIELD_SAME_TYPE", "warmup_ms"),
        (WORKER, r"uint32 freed_sequences = 1;", "uint32 freed_sequences = 2;", "FIELD_NO_DELETE", "freed_sequences"),
    ],
    ids=["deleted field", "renamed rpc", "changed field type", "renumbered field"],
)
def test_a_breaking_change_is_reported(protos_copy, current_image, file, pattern, replacement, rule, name):
    edit(protos_copy, file, pattern, replacement)
    code, findings = buf("breaking", str(protos_copy), "--against", str(current_image))
    assert code != 0
    assert any(f["type"] == rule and f'"{name}"' in f["message"] and f["path"].endswith(file) for f in findings), (
        findings
    )


def test_an_added_field_is_not_breaking(protos_copy, current_image):
    """The check must let the API grow: a new field on a request message passes."""
    edit(
        protos_copy,
        ROUTER,
        r"^message SamplingParameters \{\n",
        "message SamplingParameters {\n  uint32 a_field_added_by_the_test = 999;\n",
    )
    assert buf("lint", str(protos_copy)) == (0, [])
    assert buf("breaking", str(protos_copy), "--against", str(current_image)) == (0, [])


def test_lint_catches_a_request_type_shared_between_rpcs(protos_copy):
    edit(protos_copy, ROUTER, r"rpc GenerateStream\(GenerateStreamRequest\)", "rpc GenerateStream(GenerateRequest)")
    code, findings = buf("lint", str(protos_copy))
    assert code != 0
    assert {"RPC_REQUEST_STANDARD_NAME", "RPC_REQUEST_RESPONSE_UNIQUE"} <= {f["type"] for f in findings}, findings
