"""The image installs from lock files (deploy/docker/requirements-{cpu,gpu}.lock, written by
deploy/docker/lock.sh): every pin exact and hashed, every dependency pyproject.toml and
deploy/docker/image-requirements.in declare pinned to a version they accept (a stale lock fails here before
it fails an image build), and the commands the convert Job runs come from a declared package."""

from __future__ import annotations

import re
import tomllib

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.k8s import DEPLOY, REPO, pod_spec

DOCKER = DEPLOY / "docker"
VARIANTS = {"cpu": (), "gpu": ("cuda",)}
# The image's platforms: Linux, CPython 3.12, x86_64 or arm64.
ENVIRONMENTS = [
    {
        **default_environment(),
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "python_version": "3.12",
        "python_full_version": "3.12.0",
        "platform_machine": machine,
    }
    for machine in ("x86_64", "aarch64")
]
# Commands the convert Job's script runs -> the distribution that provides each.
JOB_COMMANDS = {"colibri": "colibri", "hf": "huggingface-hub"}


def _lock_entries(variant: str) -> list[tuple[Requirement, list[str]]]:
    """Each requirement of the lock with its hashes (continuation lines joined, comments dropped)."""
    text = (DOCKER / f"requirements-{variant}.lock").read_text()
    entries = []
    for block in re.sub(r" \\\n\s+", " ", text).splitlines():
        block = block.split("#", 1)[0].strip()
        if block:
            spec, *hashes = block.split(" --hash=")
            entries.append((Requirement(spec), hashes))
    return entries


def _pinned(variant: str, env: dict) -> dict[str, str]:
    """Distribution -> the version the lock installs on `env`."""
    pins = {}
    for req, _ in _lock_entries(variant):
        if req.marker is None or req.marker.evaluate(env):
            (spec,) = req.specifier
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def _declared(extras: tuple[str, ...]) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"]) + [d for e in extras for d in project["optional-dependencies"][e]]
    lines += [line.split("#", 1)[0].strip() for line in (DOCKER / "image-requirements.in").read_text().splitlines()]
    return [Requirement(line) for line in lines if line]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_pin_is_exact_and_hashed(variant):
    entries = _lock_entries(variant)
    assert len(entries) >= 20, f"{variant}: {len(entries)} pins"
    for req, hashes in entries:
        (spec,) = req.specifier
        assert spec.operator == "==", f"{variant}: {req} is not pinned to one version"
        assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), f"{variant}: {req.name}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_lock_pins_every_declared_dependency(variant):
    """pyproject.toml (and the cuda extra for gpu) plus image-requirements.in, on each of the image's platforms."""
    for env in ENVIRONMENTS:
        pins = _pinned(variant, env)
        for req in _declared(VARIANTS[variant]):
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            name = canonicalize_name(req.name)
            assert name in pins, (
                f"requirements-{variant}.lock misses {req} ({env['platform_machine']}): run deploy/docker/lock.sh"
            )
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"requirements-{variant}.lock pins {name}=={pins[name]}, pyproject asks {req}: "
                "run deploy/docker/lock.sh"
            )


@pytest.mark.parametrize("variant", VARIANTS)
def test_lock_is_written_by_the_lock_script(variant):
    header = (DOCKER / f"requirements-{variant}.lock").read_text().splitlines()[:2]
    assert header[1].strip() == "#    deploy/docker/lock.sh", f"requirements-{variant}.lock was not written by lock.sh"
    script = (DOCKER / "lock.sh").read_text()
    assert re.search(r"^EXCLUDE_NEWER=\d{4}-\d\d-\d\dT", script, re.M), "the resolution must not move with time"
    assert "--generate-hashes" in script and "--universal" in script


def test_install_script_installs_from_the_lock_with_hashes():
    script = (DOCKER / "install.sh").read_text()
    lock = script.index('--require-hashes -r "$lock"')
    own = script.index('--no-deps "$target"')
    check = script.index("-m pip check")
    assert lock < own < check, "lock first, then colibri without resolving, then pip check"
    assert 'lock="$src/deploy/docker/requirements-$variant.lock"' in script
    allowed = {line[1:].strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert {f"deploy/docker/requirements-{v}.lock" for v in VARIANTS} <= allowed, ".dockerignore keeps the locks out"


def test_convert_job_commands_come_from_declared_packages(renderings):
    """The Job runs on the CPU image: every command its script calls is installed by a declared package."""
    (c,) = pod_spec(renderings["convert"].one("Job", "colibri-convert"))["containers"]
    assert c["image"].endswith("-cpu")
    # a command at a line's start, or run by the script's `step` (in the background, waited for)
    commands = set(re.findall(r"^\s*(?:if .*then )?(?:step )?([a-z][\w-]*) ", c["args"][0], re.M)) & set(JOB_COMMANDS)
    assert commands == set(JOB_COMMANDS), f"the script's commands changed: {commands}"
    declared = {canonicalize_name(r.name) for r in _declared(())}
    pins = _pinned("cpu", ENVIRONMENTS[0])
    for command, dist in JOB_COMMANDS.items():
        if dist == "colibri":
            continue
        assert dist in declared, f"`{command}` comes from {dist}, which the image does not declare"
        assert dist in pins, f"`{command}` comes from {dist}, which requirements-cpu.lock does not pin"
