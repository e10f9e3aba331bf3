"""The properties the pod's lifecycle depends on, asserted on the rendered manifests (every overlay and
component): sidecar order, probes and their named health services, drain vs grace period, the Unix socket,
secrets as files, the read-only model, the security context, GPU resources and the scrape targets."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.deploy.k8s import (
    DEPLOY,
    REPO,
    SERVER_RENDERINGS,
    all_containers,
    container,
    flag,
    mount_of,
    pod_spec,
    volume,
)

LIVENESS, READINESS = "colibri.liveness", "colibri.readiness"
UID = 10001
# Flags whose value is a secret: only their *-file forms may appear in args.
SECRET_FLAGS = ("auth-token", "worker-token", "tls-key", "tls-cert", "tls-client-ca", "api-key", "token")


def servers(renderings):
    for name in SERVER_RENDERINGS:
        r = renderings[name]
        yield name, r, pod_spec(r.one("Deployment", "colibri"))


def pods(renderings):
    """Every pod template: the server Deployment of each rendering and the convert Job."""
    for name, _r, spec in servers(renderings):
        yield name, spec
    yield "convert", pod_spec(renderings["convert"].one("Job", "colibri-convert"))


def _port_names(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def test_worker_is_a_native_sidecar_started_before_the_router(renderings):
    for name, _, spec in servers(renderings):
        init = [c["name"] for c in spec["initContainers"]]
        assert init == ["prepare", "worker"], name
        assert "restartPolicy" not in container(spec, "prepare"), f"{name}: prepare must run to completion"
        assert container(spec, "worker")["restartPolicy"] == "Always", f"{name}: worker is not a sidecar"
        assert [c["name"] for c in spec["containers"]] == ["router"], name
        assert container(spec, "worker")["args"][0] == "worker"
        assert container(spec, "router")["args"][0] == "router"


def test_service_links_off_and_no_api_token(renderings):
    for name, spec in pods(renderings):
        assert spec["enableServiceLinks"] is False, name
        assert spec["automountServiceAccountToken"] is False, name


def test_grace_period_covers_prestop_and_both_drains(renderings):
    for name, _, spec in servers(renderings):
        router, worker = container(spec, "router"), container(spec, "worker")
        router_drain = float(flag(router["args"], "drain-timeout-s"))
        worker_drain = float(flag(worker["args"], "drain-timeout-s"))
        pre_stop = router["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep", name
        # Kubernetes stops the router (preStop, then SIGTERM and its drain) and only then the worker sidecar.
        needed = int(pre_stop[1]) + router_drain + worker_drain
        assert spec["terminationGracePeriodSeconds"] > needed, (
            f"{name}: grace {spec['terminationGracePeriodSeconds']} s <= preStop + drains ({needed} s)"
        )
        assert "lifecycle" not in worker, f"{name}: the worker needs no preStop (it stops after the router)"


def test_probes_use_grpc_health_with_named_services(renderings):
    for name, _, spec in servers(renderings):
        for c in (container(spec, "worker"), container(spec, "router")):
            ports = _port_names(c)
            for kind, service in (("startupProbe", None), ("readinessProbe", READINESS), ("livenessProbe", LIVENESS)):
                probe = c[kind]
                where = f"{name}: {c['name']} {kind}"
                assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, where
                assert probe["grpc"]["service"] in (LIVENESS, READINESS), f"{where}: not a named service"
                if service:
                    assert probe["grpc"]["service"] == service, where
                assert probe["grpc"]["port"] in ports.values(), f"{where}: port is not a declared containerPort"
                assert probe["timeoutSeconds"] < probe["periodSeconds"], where


def test_probe_ports_are_the_ports_the_processes_listen_on(renderings):
    for name, _, spec in servers(renderings):
        worker, router = container(spec, "worker"), container(spec, "router")
        # The worker's RPCs are on the Unix socket only; its TCP port serves health (probes reach the pod IP).
        assert flag(worker["args"], "port") is None, f"{name}: the worker must not expose its RPCs over TCP"
        health = int(flag(worker["args"], "health-port"))
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert worker[kind]["grpc"]["port"] == health, f"{name}: worker {kind}"
        # The router answers health on its public port, or on a plaintext health port when the port has TLS.
        router_health = int(flag(router["args"], "health-port") or flag(router["args"], "port"))
        if flag(router["args"], "tls-cert-file"):
            assert flag(router["args"], "health-port"), f"{name}: kubelet gRPC probes cannot speak TLS"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert router[kind]["grpc"]["port"] == router_health, f"{name}: router {kind}"


def test_startup_allows_a_slow_model_load(renderings):
    for name, _, spec in servers(renderings):
        worker = container(spec, "worker")["startupProbe"]
        assert worker["grpc"]["service"] == READINESS, f"{name}: the router should start on a warm worker"
        assert worker["periodSeconds"] * worker["failureThreshold"] >= 15 * 60, name
        router = container(spec, "router")["startupProbe"]
        assert router["periodSeconds"] * router["failureThreshold"] >= 2 * 60, name


def test_router_and_worker_share_a_unix_socket_on_an_emptydir(renderings):
    for name, _, spec in servers(renderings):
        worker, router = container(spec, "worker"), container(spec, "router")
        sock = flag(worker["args"], "socket")
        assert flag(router["args"], "worker") == f"unix://{sock}", name
        mounts = {mount_of(c, sock)["name"] for c in (worker, router)}
        assert len(mounts) == 1, f"{name}: the socket directory is not one shared volume"
        assert "emptyDir" in volume(spec, mounts.pop()), name


def test_worker_token_file_is_shared_and_generated_per_pod(renderings):
    for name, _, spec in servers(renderings):
        worker, router, prepare = (container(spec, n) for n in ("worker", "router", "prepare"))
        token = flag(worker["args"], "auth-token-file")
        assert token and flag(router["args"], "worker-token-file") == token, name
        vols = {mount_of(c, token)["name"] for c in (worker, router, prepare)}
        assert len(vols) == 1, name
        v = volume(spec, vols.pop())
        assert v["emptyDir"].get("medium") == "Memory", f"{name}: the token must not touch the node's disk"
        assert token in prepare["args"][0], f"{name}: prepare does not write {token}"
        assert mount_of(worker, token)["readOnly"] and mount_of(router, token)["readOnly"], name


def test_secrets_are_files_never_args_or_env(renderings):
    for name, spec in pods(renderings):
        for c in all_containers(spec):
            for arg in c.get("args", []) + c.get("command", []):
                m = re.match(r"--([a-z-]+)", arg)
                if m and m.group(1) in SECRET_FLAGS:
                    pytest.fail(f"{name}: {c['name']} passes a secret in argv: {arg}")
            for env in c.get("env", []):
                assert "secretKeyRef" not in env.get("valueFrom", {}), f"{name}: {c['name']} env {env['name']}"
            for src in c.get("envFrom", []):
                assert "secretRef" not in src, f"{name}: {c['name']} envFrom a Secret"
        for v in spec.get("volumes", []):
            if "secret" in v:
                # Without subPath, a rotated Secret reaches the mounted files (the processes reload them).
                for c in all_containers(spec):
                    for m in c.get("volumeMounts", []):
                        if m["name"] == v["name"]:
                            assert "subPath" not in m and m.get("readOnly"), f"{name}: {c['name']} {m}"


def test_file_flags_point_into_mounted_volumes(renderings):
    for name, _, spec in servers(renderings):
        for c in (container(spec, "worker"), container(spec, "router")):
            for arg in c["args"]:
                m = re.match(r"--([a-z-]+(?:-file|model|config))=(/.*)", arg)
                if m:
                    assert mount_of(c, m.group(2)), f"{name}: {c['name']} {arg}: nothing mounted there"


def test_model_is_mounted_read_only(renderings):
    for name, _, spec in servers(renderings):
        models = volume(spec, "models")["persistentVolumeClaim"]
        assert models["claimName"] == "colibri-models" and models["readOnly"] is True, name
        for c in all_containers(spec):
            for m in c.get("volumeMounts", []):
                if m["name"] == "models":
                    assert m["readOnly"] is True, f"{name}: {c['name']} mounts the model writable"
    job = pod_spec(renderings["convert"].one("Job", "colibri-convert"))
    assert volume(job, "models")["persistentVolumeClaim"]["claimName"] == "colibri-models"


def test_security_context(renderings):
    for name, spec in pods(renderings):
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == UID and pod["fsGroup"] == UID, name
        assert pod["seccompProfile"]["type"] == "RuntimeDefault", name
        for c in all_containers(spec):
            sc, where = c["securityContext"], f"{name}: {c['name']}"
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == UID, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc.get("privileged", False) is False, where
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), where
            assert sc["seccompProfile"]["type"] == "RuntimeDefault", where
            # A read-only root needs a writable /tmp.
            if c["name"] != "prepare":
                assert mount_of(c, "/tmp"), f"{where}: no writable /tmp"


def test_every_container_has_memory_requests_and_limits(renderings):
    for name, spec in pods(renderings):
        for c in all_containers(spec):
            res = c["resources"]
            assert res["requests"]["memory"] and res["limits"]["memory"], f"{name}: {c['name']}"
            assert res["requests"]["cpu"], f"{name}: {c['name']}"


def test_gpu_overlay_gives_the_worker_one_gpu(renderings):
    for name in ("gpu", "production"):
        spec = pod_spec(renderings[name].one("Deployment", "colibri"))
        worker = container(spec, "worker")["resources"]
        assert worker["limits"]["nvidia.com/gpu"] == 1 and worker["requests"]["nvidia.com/gpu"] == 1, name
        assert worker["requests"]["memory"] == worker["limits"]["memory"], f"{name}: pinned memory is not elastic"
        for c in all_containers(spec):
            if c["name"] != "worker":
                assert "nvidia.com/gpu" not in str(c.get("resources")), f"{name}: {c['name']} holds a GPU"
                # The CUDA base image sets NVIDIA_VISIBLE_DEVICES=all, and the NVIDIA runtime (by default) hands
                # every GPU of the node to an unprivileged container that asks for none but carries it.
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                assert env.get("NVIDIA_VISIBLE_DEVICES") == "void", (
                    f"{name}: {c['name']} runs the CUDA image without a GPU: it would see every GPU of the node"
                )
        assert "NVIDIA_VISIBLE_DEVICES" not in str(container(spec, "worker").get("env")), (
            f"{name}: the device plugin names the worker's GPU"
        )
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]), name


def test_backend_per_overlay(renderings):
    expected = {
        "gpu": "cuda",
        "production": "cuda",
        "cpu": "cpu",
        "cpu+monitoring": "cpu",
        "cpu+hpa": "cpu",
        "cpu+tls+mtls": "cpu",
        "cpu+private-registry": "cpu",
    }
    for name, r, spec in servers(renderings):
        env_maps = {src["configMapRef"]["name"] for c in all_containers(spec) for src in c.get("envFrom", [])}
        assert len(env_maps) == 1, name
        env = r.one("ConfigMap", env_maps.pop())["data"]
        assert env["COLIBRI_BACKEND"] == expected[name], name
        assert all(k == "LOG_FORMAT" or k.startswith(("COLIBRI_", "OTEL_")) for k in env), name
        assert not any(k in env for k in ("COLIBRI_PORT", "COLIBRI_MAX_MESSAGE_BYTES")), (
            f"{name}: a setting that differs between router and worker in the shared env"
        )
        if expected[name] == "cpu":
            assert "nvidia.com/gpu" not in r.yaml_text, name


def test_service_exposes_grpc_over_h2c_http_and_both_metrics_ports(renderings):
    for name, r, spec in servers(renderings):
        router, worker = container(spec, "router"), container(spec, "worker")
        tls = bool(flag(router["args"], "tls-cert-file"))
        for svc in r.of_kind("Service"):
            assert svc["spec"]["selector"] == spec_labels(r), f"{name}: {svc['metadata']['name']} selector"
            grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
            assert grpc["targetPort"] == "grpc" and _port_names(router)["grpc"] == int(flag(router["args"], "port"))
            assert grpc.get("appProtocol") == (None if tls else "kubernetes.io/h2c"), name
        ports = {p["name"]: p for p in r.one("Service", "colibri")["spec"]["ports"]}
        # The HTTP front shares the gRPC port's TLS settings: proxies must speak what it speaks.
        assert ports["http"]["targetPort"] == "http", name
        assert _port_names(router)["http"] == int(flag(router["args"], "http-port")), name
        assert ports["http"]["appProtocol"] == ("https" if tls else "http"), name
        assert _port_names(router)["metrics-router"] == int(flag(router["args"], "metrics-port")) == 9090
        assert _port_names(worker)["metrics-worker"] == int(flag(worker["args"], "metrics-port")) == 9091
        for container_ in (router, worker):
            # every interface, IPv6 included: loopback metrics cannot be scraped, 0.0.0.0 not on IPv6-only clusters
            assert flag(container_["args"], "metrics-host") == "::", f"{name}: metrics not on every interface"
        assert {"metrics-router", "metrics-worker"} <= set(ports), name
        # Health ports are for the kubelet only.
        assert not any(p["name"].startswith("health") for p in ports.values()), name


def spec_labels(r) -> dict:
    return r.one("Deployment", "colibri")["spec"]["selector"]["matchLabels"]


def test_selectors_match_only_server_pods(renderings):
    for name, r, _ in servers(renderings):
        template = r.one("Deployment", "colibri")["spec"]["template"]["metadata"]["labels"]
        selector = spec_labels(r)
        assert selector.items() <= template.items() and selector["app.kubernetes.io/component"] == "server"
        for obj in r.of_kind("PodDisruptionBudget") + r.of_kind("NetworkPolicy") + r.of_kind("PodMonitor"):
            sel = obj["spec"].get("selector", obj["spec"].get("podSelector"))["matchLabels"]
            assert sel.items() <= template.items(), f"{name}: {obj['kind']} misses the server pods"
    job_labels = renderings["convert"].one("Job", "colibri-convert")["spec"]["template"]["metadata"]["labels"]
    assert job_labels["app.kubernetes.io/component"] == "convert"


def test_pdb_and_rollout_keep_serving(renderings):
    for name, r, _ in servers(renderings):
        pdb = r.one("PodDisruptionBudget", "colibri")["spec"]
        assert pdb["maxUnavailable"] == 1 and pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow", name
        strategy = r.one("Deployment", "colibri")["spec"]["strategy"]["rollingUpdate"]
        assert strategy["maxUnavailable"] == 0, name
    # With one replica the budget lets a drain evict it (never blocked for good): the docs say the API is then down.
    docs = (REPO / "docs" / "deploy.md").read_text()
    (disruptions,) = [p for p in docs.split("\n- ") if p.startswith("**Disruptions.**")]
    assert "single replica" in disruptions and "the API is down until its replacement" in disruptions, disruptions
    assert "at least 2 replicas" in disruptions


def test_network_policy_ports_match_the_containers(renderings):
    for name, r, spec in servers(renderings):
        policy = r.one("NetworkPolicy", "colibri")["spec"]
        allowed = {p["port"] for rule in policy["ingress"] for p in rule["ports"]}
        router, worker = container(spec, "router"), container(spec, "worker")
        assert allowed == {
            int(flag(router["args"], "port")),
            int(flag(router["args"], "http-port")),
            int(flag(router["args"], "metrics-port")),
            int(flag(worker["args"], "metrics-port")),
        }, name
        assert set(policy["policyTypes"]) == {"Ingress", "Egress"}, name


def test_podmonitor_scrapes_both_processes(renderings):
    for name in ("production", "cpu+monitoring"):
        r = renderings[name]
        spec = pod_spec(r.one("Deployment", "colibri"))
        declared = {n for c in all_containers(spec) for n in _port_names(c)}
        endpoints = {e["port"] for e in r.one("PodMonitor", "colibri")["spec"]["podMetricsEndpoints"]}
        assert endpoints == {"metrics-router", "metrics-worker"} and endpoints <= declared, name


def test_hpa_owns_the_replica_count(renderings):
    for name in ("production", "cpu+hpa"):
        r = renderings[name]
        hpa = r.one("HorizontalPodAutoscaler", "colibri")["spec"]
        assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "colibri"}
        assert [m["pods"]["metric"]["name"] for m in hpa["metrics"]] == ["colibri_queue_size"]
        assert "replicas" not in r.one("Deployment", "colibri")["spec"], f"{name}: apply would reset the HPA"
    assert renderings["cpu"].one("Deployment", "colibri")["spec"]["replicas"] >= 1


def test_tls_certificate_feeds_the_mounted_secret(renderings):
    for name in ("production", "cpu+tls+mtls"):
        r = renderings[name]
        spec = pod_spec(r.one("Deployment", "colibri"))
        router = container(spec, "router")
        secret = r.one("Certificate", "colibri-tls")["spec"]["secretName"]
        mount = mount_of(router, flag(router["args"], "tls-cert-file"))
        assert volume(spec, mount["name"])["secret"]["secretName"] == secret, name
        assert mount_of(router, flag(router["args"], "tls-key-file")) == mount, name
    mtls = container(pod_spec(renderings["cpu+tls+mtls"].one("Deployment", "colibri")), "router")
    assert flag(mtls["args"], "tls-client-ca-file") == "/etc/colibri/tls/ca.crt"


def test_convert_job(renderings):
    r = renderings["convert"]
    job = r.one("Job", "colibri-convert")
    spec = pod_spec(job)
    assert spec["restartPolicy"] == "Never"
    # A stuck download or conversion does not hold the volume forever; the documented `kubectl wait` outlasts it.
    deadline = job["spec"].get("activeDeadlineSeconds")
    assert deadline and 3600 <= deadline <= 24 * 3600, f"activeDeadlineSeconds: {deadline}"
    for doc in (DEPLOY / "k8s" / "convert" / "kustomization.yaml", REPO / "docs" / "deploy.md"):
        waits = re.findall(r"job/colibri-convert --timeout=(\d+)h", doc.read_text())
        assert waits and all(int(h) * 3600 >= deadline for h in waits), f"{doc.name}: kubectl wait --timeout={waits}"
    (c,) = spec["containers"]
    script = c["args"][0]
    for step in ("colibri convert", "colibri router-gen", "colibri verify"):
        assert step in script, step
    env_map = r.one("ConfigMap", c["envFrom"][0]["configMapRef"]["name"])["data"]
    servers_model = flag(container(pod_spec(renderings["gpu"].one("Deployment", "colibri")), "worker")["args"], "model")
    assert env_map["MODEL_DIR"] == servers_model, "the Job writes where the servers read"
    assert c["image"].endswith("-cpu"), "converting needs no GPU"
    # hf's start-up query of PyPI for a newer release is off: the image pins hf
    assert {"name": "HF_HUB_DISABLE_UPDATE_CHECK", "value": "1"} in c["env"]
    assert mount_of(c, env_map["MODEL_DIR"]).get("readOnly") is not True
    # The servers wait for the model's manifest, which appears when the Job moves the verified model in.
    prepare = container(pod_spec(renderings["gpu"].one("Deployment", "colibri")), "prepare")
    assert f"{servers_model}/colibri.json" in prepare["args"][0]


def test_config_file_keys_are_documented_settings():
    """Each key of the ConfigMap's config.yaml is a setting of its section in docs/configuration.md."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in (REPO / "docs" / "configuration.md").read_text().splitlines():
        heading = re.match(r"#+ .*section `(\w+):`", line)
        if heading:
            current = sections.setdefault(heading.group(1), set())
        elif line.startswith("#"):
            current = None
        elif current is not None and (m := re.match(r"\| `--([a-z0-9-]+)`", line)):
            current.add(m.group(1).replace("-", "_"))
    assert {"router", "worker", "engine"} <= set(sections), "docs/configuration.md: section tables not found"
    config = yaml.safe_load((DEPLOY / "k8s" / "base" / "config.yaml").read_text())
    for section, values in config.items():
        unknown = set(values) - sections[section]
        assert not unknown, f"config.yaml {section}: not settings of that section: {sorted(unknown)}"


def test_docs_point_every_placeholder_image_at_a_registry():
    """A kustomization that names the image without a registry (Docker Hub's `colibri`, which does not exist) is
    one docs/deploy.md tells the operator to point at their registry: the convert Job has its own."""
    docs = (REPO / "docs" / "deploy.md").read_text()
    for path in sorted((DEPLOY / "k8s").rglob("kustomization.yaml")):
        for image in yaml.safe_load(path.read_text()).get("images", []):
            if "/" not in image.get("newName", image["name"]):
                rel = path.parent.relative_to(REPO)
                assert f"cd {rel} && kustomize edit set image {image['name']}=" in docs, (
                    f"{rel} pulls {image.get('newName', image['name'])}:{image.get('newTag')}: docs/deploy.md does "
                    "not say to point it at a registry"
                )


def test_private_registry_component_gives_every_pod_the_pull_secret(renderings):
    """With components/private-registry the server pods and the convert Job's pod name the registry Secret, which
    docs/deploy.md says how to create; without it, none names one (a missing Secret would only warn on every pull)."""
    workloads = {
        "cpu+private-registry": ("Deployment", "colibri"),
        "convert+private-registry": ("Job", "colibri-convert"),
    }
    for name, (kind, workload) in workloads.items():
        spec = pod_spec(renderings[name].one(kind, workload))
        assert spec.get("imagePullSecrets") == [{"name": "colibri-registry"}], name
    for name, spec in pods(renderings):
        if not name.endswith("+private-registry"):
            assert "imagePullSecrets" not in spec, f"{name}: a pull secret without the component"
    docs = (REPO / "docs" / "deploy.md").read_text()
    assert "create secret docker-registry colibri-registry" in docs and "components/private-registry" in docs


def _quantity_bytes(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(q))
    assert m and (m.group(2) in units or not m.group(2)), f"unexpected quantity {q}"
    return int(m.group(1)) * units.get(m.group(2), 1)


def test_disk_backed_volumes_are_requested_as_ephemeral_storage(renderings):
    """A node-disk emptyDir (the kernel cache, /tmp) is capped by its sizeLimit, but only ephemeral-storage requests
    reserve that disk: without them the scheduler places the pod on a node with no room, and under disk pressure the
    kubelet evicts first the pods that use more than they requested (anything, for a request of zero): a GPU replica
    that takes minutes to warm up. Each pod requests at least what its disk emptyDirs may hold, each container at
    least what the ones it mounts may hold."""
    for name, spec in pods(renderings):
        disk = {
            v["name"]: v["emptyDir"]
            for v in spec.get("volumes", [])
            if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"
        }
        for volume_name, empty_dir in disk.items():
            assert "sizeLimit" in empty_dir, f"{name}: emptyDir {volume_name} has no sizeLimit"
        requested = 0
        for c in all_containers(spec):
            request = _quantity_bytes(c["resources"].get("requests", {}).get("ephemeral-storage", "0"))
            mounted = {m["name"] for m in c.get("volumeMounts", []) if m["name"] in disk}
            need = sum(_quantity_bytes(disk[v]["sizeLimit"]) for v in mounted)
            assert request >= need, (
                f"{name}: {c['name']} mounts {sorted(mounted)} (up to {need} bytes) and requests {request} bytes of "
                "ephemeral storage"
            )
            requested += request
        total = sum(_quantity_bytes(d["sizeLimit"]) for d in disk.values())
        assert requested >= total, f"{name}: the pod requests {requested} bytes, its disk emptyDirs hold up to {total}"
