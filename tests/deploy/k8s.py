"""Helpers for the deployment tests: finding the tools, rendering the kustomizations, reading the objects.

Nothing here needs a cluster or the network: `kubectl kustomize` (or a standalone `kustomize build`) renders
locally, kubernetes-validate ships the schemas, checkov runs with --skip-download, hadolint is a static binary.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"

# Everything the tests render: name -> (kustomization directory, components composed on top of it).
# Components are composed in a temporary kustomization; the directories are relative to deploy/k8s.
RENDERINGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gpu": ("overlays/gpu", ()),
    "cpu": ("overlays/cpu", ()),
    "convert": ("convert", ()),
    "production": ("examples/production", ()),
    "cpu+monitoring": ("overlays/cpu", ("components/monitoring",)),
    "cpu+hpa": ("overlays/cpu", ("components/hpa",)),
    "cpu+tls+mtls": ("overlays/cpu", ("components/tls", "components/mtls")),
    "cpu+private-registry": ("overlays/cpu", ("components/private-registry",)),
    "convert+private-registry": ("convert", ("components/private-registry",)),
}
# Renderings that hold the server Deployment.
SERVER_RENDERINGS = [name for name in RENDERINGS if not name.startswith("convert")]

# Kinds defined by CRDs: no official schema; each is named here on purpose so that no other kind is skipped.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("cert-manager.io/v1", "Certificate"),
}
# Kubernetes versions the manifests are validated against: 1.29 is the first with native sidecars on by
# default (beta), 1.33 the first with them GA.
K8S_VERSIONS = ("1.29", "1.33")


def find_tool(name: str, env: str | None = None, extra_dirs: tuple[Path, ...] = ()) -> str | None:
    """`env` (a path), else PATH, else next to this Python (a venv's bin/), else `extra_dirs`."""
    if env and os.environ.get(env):
        return os.environ[env] if os.access(os.environ[env], os.X_OK) else None
    found = shutil.which(name)
    if found:
        return found
    for directory in (Path(sys.executable).parent, *extra_dirs):
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def kustomize_command() -> list[str] | None:
    """`kubectl kustomize` (kubectl >= 1.27 bundles kustomize v5), or a standalone `kustomize build`."""
    kubectl = find_tool("kubectl")
    if kubectl:
        return [kubectl, "kustomize"]
    kustomize = find_tool("kustomize")
    if kustomize:
        return [kustomize, "build"]
    return None


@dataclass
class Rendering:
    name: str
    objects: list[dict]
    stderr: str
    yaml_text: str = field(repr=False)

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = [o for o in self.of_kind(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: expected one {kind} {name or ''}, found {len(found)}"
        return found[0]


def render(command: list[str], name: str, scratch: Path) -> Rendering:
    directory, components = RENDERINGS[name]
    target = K8S / directory
    if components:
        target = scratch / name.replace("+", "_")
        target.mkdir(parents=True)
        rel = lambda p: os.path.relpath(K8S / p, target)  # noqa: E731 (kustomize refuses absolute paths)
        target.joinpath("kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "namespace": "colibri",
                    "resources": [rel(directory)],
                    "components": [rel(c) for c in components],
                }
            )
        )
    proc = subprocess.run([*command, str(target)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"rendering {name} failed:\n{proc.stderr}"
    objects = [o for o in yaml.safe_load_all(proc.stdout) if o]
    return Rendering(name, objects, proc.stderr, proc.stdout)


# --- reading a rendered pod ----------------------------------------------------------------------------------


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(spec: dict, name: str) -> dict:
    for c in spec.get("initContainers", []) + spec.get("containers", []):
        if c["name"] == name:
            return c
    raise AssertionError(f"no container named {name}")


def all_containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec.get("containers", [])


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name=value` or `--name value` in a container's args (None when absent)."""
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(args):
            return args[i + 1]
    return None


def mount_of(c: dict, path: str) -> dict | None:
    """The volume mount of `c` that holds `path` (the longest mountPath that is a prefix of it)."""
    best = None
    for m in c.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/")
        if (path == mp or path.startswith(mp + "/")) and (best is None or len(mp) > len(best["mountPath"])):
            best = m
    return best


def volume(spec: dict, name: str) -> dict:
    for v in spec.get("volumes", []):
        if v["name"] == name:
            return v
    raise AssertionError(f"no volume named {name}")


# --- the image ------------------------------------------------------------------------------------------------


def image_env() -> dict[str, str]:
    """What the Dockerfile's last stage (the image) sets with ENV, which every container starts with before the
    pod's own env (not what the stages or base images below it set; `$VAR` references are left as written)."""
    text = (DEPLOY / "Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    last_stage = re.split(r"^FROM\s", logical, flags=re.M)[-1]
    env: dict[str, str] = {}
    for instruction in re.findall(r"^ENV\s+(.*)$", last_stage, re.M):
        for word in shlex.split(instruction):
            name, _, value = word.partition("=")
            env[name] = value
    return env
