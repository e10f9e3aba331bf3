"""The rendered containers against the code that runs in them: every argument parsed by the real `colibri`
parser (exact flag names: argparse would take an abbreviation today and refuse it once another flag shares the
prefix), every process's settings resolved as the process resolves them (defaults < the mounted config file <
the image's and the pod's environment < the args), and what the pod relies on checked on those resolved values
rather than on the flags alone: the probe ports and the declared ports are the ones the processes bind, the probe
services are ones the code registers, and every environment variable a manifest sets is one something reads (a
typo'd one is silently ignored). Also: the components that need another one refuse to render without it."""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from colibri.cli import SUBCOMMANDS
from common.config import flag_values as config_flags
from common.config import load_config_file, resolve
from common.listen_address import EVERY_INTERFACE
from expert_service.engine.config import EngineConfig
from expert_service.serving import lifecycle
from expert_service.serving.main import WorkerConfig
from router_service import main as router_main
from router_service.config import RouterConfig
from tests.deploy.k8s import (
    K8S,
    REPO,
    SERVER_RENDERINGS,
    container,
    flag,
    image_env,
    kustomize_command,
    mount_of,
    pod_spec,
    volume,
)

# Each server process: its config classes and the config file section each reads.
SETTINGS = {
    "router": ((RouterConfig, "router"),),
    "worker": ((WorkerConfig, "worker"), (EngineConfig, "engine")),
}
# Environment variables that are no Colibri setting, and who reads them. A name read by Colibri's own code is
# checked to appear in that file, so that renaming it there fails here.
READ_BY_CODE = {
    "LOG_FORMAT": ("router", "worker", "common/logging_setup.py"),
    "COLIBRI_KERNEL_CACHE": ("worker", "expert_service/kernels/jit_cache.py"),
    "COLIBRI_WORKER_TOKEN": ("router", "worker", "common/auth.py"),
}
READ_ELSEWHERE = {
    "NVIDIA_VISIBLE_DEVICES": "the NVIDIA container runtime (which GPUs it mounts into the container)",
    "CUDA_CACHE_PATH": "the CUDA driver (its PTX JIT cache)",
    "PATH": "the shell and the kubelet's exec (preStop)",
    "PYTHONDONTWRITEBYTECODE": "the Python interpreter",
    "PYTHONUNBUFFERED": "the Python interpreter",
}
OTEL_PREFIX = "OTEL_"  # the OpenTelemetry SDK's (common/tracing.py reads the endpoint and the service name)


def servers(renderings):
    for name in SERVER_RENDERINGS:
        r = renderings[name]
        yield name, r, pod_spec(r.one("Deployment", "colibri"))


def subcommand_parser(subcommand: str) -> argparse.ArgumentParser:
    """`colibri SUBCOMMAND`'s parser as colibri.cli builds it, but refusing abbreviated flags."""
    parser = argparse.ArgumentParser(prog=f"colibri {subcommand}", allow_abbrev=False)
    importlib.import_module(SUBCOMMANDS[subcommand][0]).add_arguments(parser)
    return parser


def parse(c: dict, where: str) -> argparse.Namespace:
    subcommand, *args = c["args"]
    parser = subcommand_parser(subcommand)
    options = {s for action in parser._actions for s in action.option_strings}
    for arg in args:
        if arg.startswith("--"):
            assert arg.split("=", 1)[0] in options, f"{where}: colibri {subcommand} has no flag {arg.split('=')[0]}"
    try:
        return parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: colibri {subcommand} refuses its args {args} (the container would exit 2)")


def environment(r, c: dict) -> dict[str, str]:
    """What the process sees: the image's ENV, then envFrom ConfigMaps, then env (later wins, as in Kubernetes)."""
    env = dict(image_env())
    for source in c.get("envFrom", []):
        env.update(r.one("ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return env


def resolved(r, spec: dict, name: str, where: str, scratch: Path) -> dict:
    """The container's settings, resolved as the process resolves them: {config class name: instance}. The
    --config file is the mounted ConfigMap's, written out."""
    c = container(spec, name)
    ns = parse(c, where)
    if ns.config:
        mount = mount_of(c, ns.config)
        assert mount, f"{where}: --config {ns.config}: nothing mounted there"
        key = mount.get("subPath") or os.path.relpath(ns.config, mount["mountPath"])
        data = r.one("ConfigMap", volume(spec, mount["name"])["configMap"]["name"])["data"]
        ns.config = str(scratch / f"{where.replace(' ', '_').replace('+', '_')}.yaml")
        Path(ns.config).write_text(data[key])
    env = environment(r, c)
    out = {}
    for cls, section in SETTINGS[name]:
        try:
            out[cls.__name__] = resolve(
                cls, file_values=load_config_file(ns.config, section), env=env, flags=config_flags(ns, cls)
            )
        except Exception as e:  # a ConfigError is the process's exit 2 at every start: a crash loop
            pytest.fail(f"{where}: {cls.__name__} does not resolve: {e}")
    return out


def test_container_args_are_flags_of_the_real_cli(renderings):
    for name, _r, spec in servers(renderings):
        for c in (container(spec, "worker"), container(spec, "router")):
            parse(c, f"{name}: {c['name']}")


def test_settings_resolve_and_the_pod_agrees_with_them(renderings, tmp_path):
    for name, r, spec in servers(renderings):
        router_c, worker_c = container(spec, "router"), container(spec, "worker")
        router = resolved(r, spec, "router", f"{name} router", tmp_path)["RouterConfig"]
        worker = resolved(r, spec, "worker", f"{name} worker", tmp_path)["WorkerConfig"]

        # Probes: on the plaintext health port each process binds to every address (probes reach the pod IP), IPv6
        # and IPv4 alike (`::`, dual-stack: 0.0.0.0 would leave the HTTP and metrics ports unreachable on IPv6-only
        # clusters).
        assert router.health_port and router.host == EVERY_INTERFACE, f"{name}: router health port"
        assert worker.health_port and worker.health_host == EVERY_INTERFACE, f"{name}: worker health port"
        for c, port in ((router_c, router.health_port), (worker_c, worker.health_port)):
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[kind]["grpc"]["port"] == port, f"{name}: {c['name']} {kind} is not on its health port"

        # Every declared port is one the process listens on, to every address; and every such port is declared.
        router_ports = {router.port, router.http_port, router.metrics_port, router.health_port} - {0}
        worker_ports = {worker.health_port, worker.metrics_port} - {0}
        assert {p["containerPort"] for p in router_c["ports"]} == router_ports, name
        assert {p["containerPort"] for p in worker_c["ports"]} == worker_ports, name
        assert router.metrics_host == worker.metrics_host == EVERY_INTERFACE, name
        assert worker.socket and router.worker == f"unix://{worker.socket}", f"{name}: the worker's RPCs on its socket"

        # The in-pod token: what the router sends is what the worker accepts.
        assert router.worker_token_file == worker.auth_token_file, name
        assert router.auth_token_file and mount_of(router_c, router.auth_token_file), name
        if router.tls_cert_file:
            for path in (router.tls_cert_file, router.tls_key_file, router.tls_client_ca_file):
                if path:
                    assert "secret" in volume(spec, mount_of(router_c, path)["name"]), f"{name}: {path}"

        # Stopping: preStop, the router's drain, then the worker's (it stops after the router), within the grace.
        pre_stop = float(router_c["lifecycle"]["preStop"]["exec"]["command"][1])
        needed = pre_stop + router.drain_timeout_s + worker.drain_timeout_s
        assert spec["terminationGracePeriodSeconds"] > needed, f"{name}: grace <= {needed} s"


def test_probe_services_are_ones_the_code_registers(renderings):
    registered = {
        "router": set(router_main.LIVENESS) | set(router_main.READINESS),
        "worker": {lifecycle.LIVENESS, lifecycle.READINESS, lifecycle.WORKER_SERVICE, ""},
    }
    liveness = {"router": router_main.LIVENESS, "worker": (lifecycle.LIVENESS,)}
    for name, _r, spec in servers(renderings):
        for c in (container(spec, "worker"), container(spec, "router")):
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                service = c[kind]["grpc"].get("service", "")
                assert service in registered[c["name"]], f"{name}: {c['name']} {kind} asks for {service!r}"
            # Liveness must not ask for readiness: a worker restarting its router, or draining, is alive.
            assert c["livenessProbe"]["grpc"]["service"] in liveness[c["name"]], f"{name}: {c['name']}"


def _env_names_of(process: str) -> set[str]:
    names = set()
    for cls, _ in SETTINGS[process]:
        for f in cls.__dataclass_fields__.values():
            names.update(f.metadata.get("env", ()))
    for var, (*readers, source) in READ_BY_CODE.items():
        assert var in (REPO / source).read_text(), f"{source} no longer reads {var}"
        if process in readers:
            names.add(var)
    return names


def _known(var: str, process: str | None) -> bool:
    return (
        var in READ_ELSEWHERE or var.startswith(OTEL_PREFIX) or (process is not None and var in _env_names_of(process))
    )


def test_every_environment_variable_is_read_by_something(renderings):
    for name, r, spec in servers(renderings):
        readers: dict[str, set[str | None]] = {}  # ConfigMap given with envFrom -> the processes it is given to
        for c in spec["initContainers"] + spec["containers"]:
            process = c["args"][0] if c["name"] in ("router", "worker") else None
            for source in c.get("envFrom", []):
                readers.setdefault(source["configMapRef"]["name"], set()).add(process)
            for e in c.get("env", []):
                assert _known(e["name"], process), (
                    f"{name}: {c['name']} gets {e['name']}, which "
                    f"{'colibri ' + process if process else 'no program of that container'} reads: "
                    "a misspelt setting is ignored without a word"
                )
        # A shared ConfigMap holds settings for either process: each is read by at least one it is given to.
        for config_map, processes in readers.items():
            for var in r.one("ConfigMap", config_map)["data"]:
                assert any(_known(var, p) for p in processes), (
                    f"{name}: ConfigMap {config_map} sets {var}, which none of {sorted(map(str, processes))} reads"
                )
    for var in image_env():
        assert _known(var, "router") or _known(var, "worker"), f"the image sets {var}, which nothing reads"


def test_convert_job_environment_is_read_by_its_script_or_hf():
    pytest.importorskip("huggingface_hub", reason="huggingface_hub (the image's `hf`) is not installed")
    import huggingface_hub.constants

    hub = inspect.getsource(huggingface_hub.constants)
    job = yaml.safe_load((K8S / "convert" / "job.yaml").read_text())
    (c,) = job["spec"]["template"]["spec"]["containers"]
    script = c["args"][0]
    settings = yaml.safe_load((K8S / "convert" / "kustomization.yaml").read_text())["configMapGenerator"][0]
    for literal in settings["literals"]:
        var = literal.split("=", 1)[0]
        assert re.search(rf"\$\{{?{var}\b", script), f"the convert script never reads {var}"
    for e in c["env"]:
        assert f'"{e["name"]}"' in hub, f"huggingface_hub does not read {e['name']}"


def _render_with(components: list[str], base: str, scratch: Path) -> subprocess.CompletedProcess:
    command = kustomize_command()
    if command is None:
        pytest.skip("no kubectl or kustomize to render with")
    scratch.mkdir(parents=True)
    rel = lambda p: os.path.relpath(K8S / p, scratch)  # noqa: E731 (kustomize refuses absolute paths)
    kustomization = {"resources": [rel(base)], "components": [rel(c) for c in components]}
    scratch.joinpath("kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return subprocess.run([*command, str(scratch)], capture_output=True, text=True, timeout=120)


def test_mtls_does_not_render_without_tls(tmp_path):
    """Alone, or listed before tls, mtls would give the router --tls-client-ca-file and no certificate: it would
    exit at every start. It must fail at render time instead, naming what it misses."""
    for i, components in enumerate((["components/mtls"], ["components/mtls", "components/tls"])):
        proc = _render_with(components, "overlays/cpu", tmp_path / str(i))
        assert proc.returncode != 0, f"{components} rendered: the router would crash-loop"
        assert "colibri-tls" in proc.stderr, proc.stderr
    # On top of a kustomization that has tls (the production example), it renders, and reads the Secret's CA.
    proc = _render_with(["components/mtls"], "examples/production", tmp_path / "production")
    assert proc.returncode == 0, proc.stderr
    spec = pod_spec(next(o for o in yaml.safe_load_all(proc.stdout) if o and o["kind"] == "Deployment"))
    router = container(spec, "router")
    ca = flag(router["args"], "tls-client-ca-file")
    assert mount_of(router, ca) == mount_of(router, flag(router["args"], "tls-cert-file")), "one Secret for both"


def test_components_added_to_an_overlay_land_in_its_namespace(tmp_path):
    """Each component's header, and docs/deploy.md, say to add it to an overlay (`components:` there, or
    `kustomize edit add component`). The objects a component adds (Certificate, HPA, PodMonitor, rules, dashboard)
    take the namespace of the kustomization that lists it, not the base's: without one in the overlay they went to
    whatever namespace kubectl's context names, where the HPA scales nothing, the PodMonitor scrapes nothing and the
    Certificate's Secret never reaches the pod (which then waits for its `tls` volume)."""
    command = kustomize_command()
    if command is None:
        pytest.skip("no kubectl or kustomize to render with")
    components = [
        "../../components/monitoring",
        "../../components/hpa",
        "../../components/tls",
        "../../components/mtls",
        "../../components/private-registry",
    ]
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    for overlay in ("overlays/gpu", "overlays/cpu"):
        path = tree / overlay / "kustomization.yaml"
        kustomization = yaml.safe_load(path.read_text())
        path.write_text(yaml.safe_dump({**kustomization, "components": components}))
        proc = subprocess.run([*command, str(path.parent)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        objects = [o for o in yaml.safe_load_all(proc.stdout) if o]
        assert {"Certificate", "HorizontalPodAutoscaler", "PodMonitor"} <= {o["kind"] for o in objects}, overlay
        outside = [
            f"{o['kind']} {o['metadata']['name']}" for o in objects if o["metadata"].get("namespace") != "colibri"
        ]
        assert not outside, f"{overlay} with its components: not in the colibri namespace: {outside}"
