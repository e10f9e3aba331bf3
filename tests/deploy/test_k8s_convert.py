"""The convert Job as an object: which failures it retries (its pod failure policy, evaluated the way the Job
controller evaluates it), and how its script stops on a pod's SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from common.errors import ChecksumError, ColibriError, ConfigError, ModelFormatError
from tests.deploy.k8s import REPO, pod_spec
from tests.deploy.test_k8s_scripts import _idempotence_setup, _run_script

# A pod's container that ran out of memory, and one stopped by SIGTERM (an eviction's grace period).
OOM_KILLED, SIGTERM = 137, 143


def _job(renderings) -> dict:
    return renderings["convert"].one("Job", "colibri-convert")


def failure_action(job: dict, exit_code: int, conditions: tuple[str, ...] = ()) -> str:
    """What the Job controller does with a failed pod of `job` whose container `convert` exited with `exit_code`
    and which has the (True) pod conditions `conditions`: the first matching rule's action, else "Count" (a
    failure counted against backoffLimit), as batch/v1 podFailurePolicy is evaluated."""
    for rule in job["spec"].get("podFailurePolicy", {}).get("rules", []):
        if "onExitCodes" in rule:
            on = rule["onExitCodes"]
            if on.get("containerName", "convert") != "convert":
                continue
            matches = exit_code in on["values"]
            if matches == (on["operator"] == "In"):
                return rule["action"]
        for condition in rule.get("onPodConditions", []):
            if condition.get("status", "True") == "True" and condition["type"] in conditions:
                return rule["action"]
    return "Count"


def test_convert_job_fails_at_once_when_its_inputs_are_wrong(renderings):
    """A pod that failed on a setting or a checkpoint colibri refuses (exit 2, 3) fails the Job at once instead of
    being retried twice, each retry downloading again to fail the same way; what may pass (a network or I/O error,
    a checksum, OOMKilled) is retried, and an evicted pod is replaced without counting as a failure."""
    job = _job(renderings)
    assert pod_spec(job)["restartPolicy"] == "Never", "podFailurePolicy needs restartPolicy Never"
    assert job["spec"]["backoffLimit"] >= 1
    assert job["spec"].get("podReplacementPolicy") == "Failed", "a retry starts before the failed pod has stopped"
    for code in (ConfigError.exit_code, ModelFormatError.exit_code):
        assert failure_action(job, code) == "FailJob", f"exit {code} is retried"
    for code in (ColibriError.exit_code, ChecksumError.exit_code, OOM_KILLED, SIGTERM):
        assert failure_action(job, code) == "Count", f"exit {code}: {failure_action(job, code)}"
    for code in (ConfigError.exit_code, ColibriError.exit_code, OOM_KILLED, SIGTERM):
        assert failure_action(job, code, ("DisruptionTarget",)) == "Ignore", f"an evicted pod (exit {code}) counts"
    fail_at_once = sorted(c for c in range(256) if failure_action(job, c) == "FailJob")
    assert fail_at_once == [2, 3], fail_at_once
    docs = (REPO / "docs" / "deploy.md").read_text()
    (paragraph,) = [p for p in docs.split("\n\n") if "`podFailurePolicy`" in p]
    for code in fail_at_once:
        assert f"exit code {code}," in paragraph, f"docs/deploy.md: exit code {code} failing the Job is not said"
    assert re.search(r"Retried: exit code 1\b.*\b4\b.*\b137\b", paragraph, re.S), paragraph
    assert "`DisruptionTarget`" in paragraph


def test_convert_job_script_exits_with_the_codes_the_policy_reads(renderings, tmp_path):
    """The script's own checks exit with the code of colibri's errors of the same kind (a setting: 2, the
    checkpoint: 3), so they fail the Job at once; colibri's and hf's codes pass through unchanged."""
    job = _job(renderings)
    script, env, bin_dir, log, model = _idempotence_setup(renderings, tmp_path)
    hf_dir = Path(env["HF_DIR"])
    cases = {
        "FORCE neither empty nor 1": ({**env, "FORCE": "yes"}, "FailJob"),
        "no checkpoint": ({**env, "HF_DIR": str(hf_dir.with_name("missing"))}, "FailJob"),
        "a flag colibri convert refuses": ({**env, "FAKE_CONVERT_EXIT": "2"}, "FailJob"),
        "a malformed checkpoint": ({**env, "FAKE_CONVERT_EXIT": "3"}, "FailJob"),
        "a tensor that did not verify": ({**env, "FAKE_CONVERT_EXIT": "4"}, "Count"),
        "a disk or network error": ({**env, "FAKE_CONVERT_EXIT": "1"}, "Count"),
        "a failed download": ({**env, "HF_REPO": "org/model", "FAKE_HF_EXIT": "1"}, "Count"),
    }
    for case, (case_env, action) in cases.items():
        run = _run_script(script, case_env, bin_dir)
        assert run.returncode != 0, f"{case}: {run.stdout}"
        assert failure_action(job, run.returncode) == action, f"{case}: exit {run.returncode}, {run.stderr}"


def test_convert_job_refuses_a_missing_corpus_before_converting(renderings, tmp_path):
    """A CORPUS that is not a file fails the Job at once, before the conversion (hours, after which router-gen
    would refuse it) and before MODEL_DIR.old, which replicas may still read, is deleted."""
    job = _job(renderings)
    script, env, bin_dir, log, model = _idempotence_setup(renderings, tmp_path)
    assert _run_script(script, env, bin_dir).returncode == 0
    model.with_name("model.old").mkdir()
    before = {p: p.stat().st_mtime_ns for p in model.parent.rglob("*")}
    log.unlink()
    run = _run_script(script, {**env, "CORPUS": str(tmp_path / "gone.txt")}, bin_dir)
    assert failure_action(job, run.returncode) == "FailJob", f"exit {run.returncode}: {run.stderr}"
    assert f"CORPUS is '{tmp_path / 'gone.txt'}', which is not a file" in run.stderr
    assert not log.exists(), "something ran"
    assert {p: p.stat().st_mtime_ns for p in model.parent.rglob("*")} == before


def _names(rendering, kind: str) -> set[str]:
    return {o["metadata"]["name"] for o in rendering.of_kind(kind)}


def test_convert_kustomization_is_self_contained(renderings):
    """`kubectl apply -k deploy/k8s/convert` alone (before the servers, or without them) gives a pod that can run:
    every ServiceAccount and ConfigMap it names is in the rendering, every Secret is optional. The one thing it uses
    from the server overlays, the model claim, is one they all create, and the docs apply them first; it shares no
    object with them (deleting or pruning the convert kustomization would delete the servers' too)."""
    r = renderings["convert"]
    spec = pod_spec(_job(renderings))
    account = spec.get("serviceAccountName")
    assert account in _names(r, "ServiceAccount"), f"the Job runs as ServiceAccount {account}, which it does not create"
    assert r.one("ServiceAccount", account).get("automountServiceAccountToken") is False
    config_maps, secrets, claims = set(), [], set()
    for c in spec["containers"] + spec.get("initContainers", []):
        for source in c.get("envFrom", []):
            if "configMapRef" in source and not source["configMapRef"].get("optional"):
                config_maps.add(source["configMapRef"]["name"])
            if "secretRef" in source:
                secrets.append(source["secretRef"])
        for var in c.get("env", []):
            ref = var.get("valueFrom", {})
            if "configMapKeyRef" in ref and not ref["configMapKeyRef"].get("optional"):
                config_maps.add(ref["configMapKeyRef"]["name"])
            if "secretKeyRef" in ref:
                secrets.append(ref["secretKeyRef"])
    for v in spec.get("volumes", []):
        if "configMap" in v and not v["configMap"].get("optional"):
            config_maps.add(v["configMap"]["name"])
        if "secret" in v:
            secrets.append(v["secret"])
        if "persistentVolumeClaim" in v:
            claims.add(v["persistentVolumeClaim"]["claimName"])
    assert config_maps and config_maps <= _names(r, "ConfigMap"), config_maps
    assert all(s.get("optional") is True for s in secrets), secrets
    assert claims == {"colibri-models"}
    for name in ("gpu", "cpu", "production"):
        assert claims <= _names(renderings[name], "PersistentVolumeClaim"), f"{name} does not create {claims}"
        server = {(o["kind"], o["metadata"]["name"]) for o in renderings[name].objects}
        shared = server & {(o["kind"], o["metadata"]["name"]) for o in r.objects}
        assert not shared, f"the convert kustomization and {name} both hold {shared}"
    assert not r.of_kind("Namespace") and not r.of_kind("PersistentVolumeClaim")
    # The order the docs give: the namespace, the server overlay (the claim), then the Job.
    docs = (REPO / "docs" / "deploy.md").read_text()
    steps = [
        "kubectl create namespace colibri",
        "kubectl apply -k deploy/k8s/overlays/",
        "kubectl apply -k deploy/k8s/convert",
    ]
    positions = [docs.find(s) for s in steps]
    assert -1 not in positions and positions == sorted(positions), dict(zip(steps, positions, strict=True))
    kustomization = (REPO / "deploy" / "k8s" / "convert" / "kustomization.yaml").read_text()
    assert "kubectl create namespace colibri" in kustomization and "colibri-models" in kustomization


def test_convert_job_is_recreated_by_gitops_tools(renderings):
    """A changed setting changes the Job's immutable pod template (the ConfigMap's hashed name): Argo CD and Flux
    are told to delete and create the Job rather than apply over it, which Kubernetes refuses (the sync would fail
    until someone deleted the Job). Argo CD needs Force with Replace: Replace alone is a `kubectl replace`."""
    job = _job(renderings)
    annotations = job["metadata"]["annotations"]
    options = {o.strip() for o in annotations["argocd.argoproj.io/sync-options"].split(",")}
    assert {"Force=true", "Replace=true"} <= options, options
    assert annotations["kustomize.toolkit.fluxcd.io/force"] == "enabled"
    template = job["spec"]["template"]["metadata"].get("annotations", {})
    assert not [k for k in template if "argoproj" in k or "fluxcd" in k], "on the pod, they do nothing"
    assert re.search(
        r"colibri-convert-[a-z0-9]{10}$", pod_spec(job)["containers"][0]["envFrom"][0]["configMapRef"]["name"]
    )
    docs = (REPO / "docs" / "deploy.md").read_text()
    for text in (
        "argocd.argoproj.io/sync-options: Force=true,Replace=true",
        "kustomize.toolkit.fluxcd.io/force: enabled",
    ):
        assert text in docs, f"docs/deploy.md does not say what {text} does"


def test_convert_job_stops_its_step_at_once_on_sigterm(renderings, tmp_path):
    """A deleted pod's SIGTERM (as PID 1 the shell would ignore it without a trap, and run a trap only after its
    foreground command) stops the running conversion at once with exit 143, before it writes on beside the pod that
    replaces it; MODEL_DIR is left as it was."""
    script, env, bin_dir, log, model = _idempotence_setup(renderings, tmp_path)
    assert _run_script(script, env, bin_dir).returncode == 0
    before = {p: p.stat().st_mtime_ns for p in model.rglob("*")}
    command_env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": "/tmp", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        ["sh", "-c", script],
        env={**command_env, **env, "FORCE": "1", "FAKE_CONVERT_SLEEP": "60"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    pid_file = Path(f"{log}.pid")
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.01)
        converter = int(pid_file.read_text())
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == SIGTERM
    deadline = time.monotonic() + 5
    while _alive(converter):
        assert time.monotonic() < deadline, "the conversion kept running"
        time.sleep(0.01)
    assert {p: p.stat().st_mtime_ns for p in model.rglob("*")} == before


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))  # a zombie has ended
