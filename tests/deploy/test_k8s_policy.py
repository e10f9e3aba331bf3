"""Policy check of the rendered manifests with checkov (offline): no finding that is not justified.

checkov's kustomize framework needs a standalone kustomize binary and silently scans nothing without one,
so the tests scan the rendered YAML instead. A finding is justified by a `checkov.io/skipN: "ID=reason"`
annotation on the object; the reasons live next to the settings they explain (deploy/k8s), and the set of
skipped IDs is pinned here so that adding one is a visible change.

checkov's dependencies conflict with the project's pins (networkx, packaging), so it lives in its own venv:
the test finds it through COLIBRI_CHECKOV, PATH, this Python's bin/ or .venv-checkov/bin/.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.deploy.k8s import REPO, find_tool

# Every check skipped anywhere in deploy/k8s, and the objects that carry the annotation.
JUSTIFIED_SKIPS = {
    "CKV_K8S_11": {"Deployment/colibri", "Job/colibri-convert"},  # no CPU limits (throttling)
    "CKV_K8S_15": {"Deployment/colibri", "Job/colibri-convert"},  # imagePullPolicy IfNotPresent
    "CKV_K8S_43": {"Deployment/colibri", "Job/colibri-convert"},  # image digest pinned at release time
}
SKIP_ANNOTATION = re.compile(r"^checkov\.io/skip\d+$")


def _skip_annotations(renderings):
    for r in renderings.values():
        for obj in r.objects:
            for key, value in (obj["metadata"].get("annotations") or {}).items():
                if SKIP_ANNOTATION.match(key):
                    yield r.name, obj, key, value


def test_skip_annotations_are_justified(renderings):
    found: dict[str, set[str]] = {}
    for name, obj, key, value in _skip_annotations(renderings):
        where = f"{name}: {obj['kind']}/{obj['metadata']['name']} {key}"
        # checkov splits the value on "=" and crashes on a second one.
        assert value.count("=") == 1, f"{where}: write 'CHECK_ID=reason' with a single '=': {value!r}"
        check_id, reason = value.split("=")
        assert re.fullmatch(r"CKV2?_K8S_\d+", check_id), f"{where}: not a checkov check id: {check_id!r}"
        assert len(reason.split()) >= 6, f"{where}: {check_id} needs a real justification, got {reason!r}"
        found.setdefault(check_id, set()).add(f"{obj['kind']}/{obj['metadata']['name']}")
    assert found == JUSTIFIED_SKIPS


def test_checkov_finds_nothing_unjustified(renderings, tmp_path):
    checkov = find_tool("checkov", env="COLIBRI_CHECKOV", extra_dirs=(REPO / ".venv-checkov" / "bin",))
    if checkov is None:
        pytest.skip(
            "checkov not found (COLIBRI_CHECKOV, PATH, this venv or .venv-checkov/bin): "
            "python -m venv .venv-checkov && .venv-checkov/bin/pip install checkov==3.3.30"
        )
    for name, r in renderings.items():
        tmp_path.joinpath(f"{name.replace('+', '_')}.yaml").write_text(r.yaml_text)
    proc = subprocess.run(
        [
            checkov,
            "-d",
            str(tmp_path),
            "--framework",
            "kubernetes",
            "--skip-download",
            "--compact",
            "--output",
            "json",
        ],  # no --quiet: it drops the skipped checks
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode in (0, 1), f"checkov crashed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout)
    report = report[0] if isinstance(report, list) else report
    summary, results = report["summary"], report["results"]
    assert summary["parsing_errors"] == 0, summary
    assert summary["resource_count"] >= sum(len(r.objects) for r in renderings.values()) // 2, summary
    failed = [
        f"{c['check_id']} {c['check_name']}: {c['resource']} ({c['file_path']})" for c in results["failed_checks"]
    ]
    assert not failed, "checkov findings (fix them, or justify with a checkov.io/skipN annotation):\n" + "\n".join(
        failed
    )
    # Every justified skip is still needed: checkov reports it as skipped on the annotated objects.
    used: dict[str, set[str]] = {}
    for c in results["skipped_checks"]:
        kind, _, name = c["resource"].split(".")[:3]
        used.setdefault(c["check_id"], set()).add(f"{kind}/{name}")
    assert used == JUSTIFIED_SKIPS, f"stale or missing skips: checkov skipped {used}"
