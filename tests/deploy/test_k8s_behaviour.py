"""What the rendered objects do once applied, in a model cluster (tests/deploy/cluster.py): every selector
picks the pods it is meant for and no other, DNS resolves under the NetworkPolicies, and every port a
process listens on for others (gRPC, HTTP, both metrics ports) is reachable through the Service and the
policy by the clients it is for, while the health ports stay the kubelet's. Checked on every rendering, with
the convert Job's pod beside the servers (both live in one namespace)."""

from __future__ import annotations

import pytest

from tests.deploy.cluster import (
    CLIENT,
    HUB,
    KUBE_DNS,
    OTLP_COLLECTOR,
    PROMETHEUS,
    RESOLVERS,
    connection_allowed,
    selects,
    service_selects,
    target_port,
    workload_pods,
)
from tests.deploy.k8s import SERVER_RENDERINGS, container, flag, pod_spec

# Each port a server container declares, the flag that makes the process listen on it, and who must reach
# it. None: nobody but the kubelet, whose probes come from the node (not filtered by policies on common CNIs).
PORTS = {
    "grpc": ("router", "port", CLIENT),
    "http": ("router", "http-port", CLIENT),
    "metrics-router": ("router", "metrics-port", PROMETHEUS),
    "metrics-worker": ("worker", "metrics-port", PROMETHEUS),
    "health-router": ("router", "health-port", None),
    "health-worker": ("worker", "health-port", None),
}


def _cluster(renderings, name):
    """The server pod, the convert pod, and every NetworkPolicy of both in the namespace."""
    (server,) = workload_pods(renderings[name])
    (convert,) = workload_pods(renderings["convert"])
    policies = renderings[name].of_kind("NetworkPolicy") + renderings["convert"].of_kind("NetworkPolicy")
    return server, convert, policies


@pytest.fixture(params=SERVER_RENDERINGS)
def server_rendering(request, renderings):
    return request.param, renderings[request.param]


def test_every_declared_port_is_one_the_process_listens_on(server_rendering):
    name, r = server_rendering
    spec = pod_spec(r.one("Deployment", "colibri"))
    for c in (container(spec, "router"), container(spec, "worker")):
        for p in c.get("ports", []):
            assert p["name"] in PORTS, f"{name}: {c['name']} port {p['name']}: say who reaches it in PORTS"
            owner, port_flag, _ = PORTS[p["name"]]
            assert c["name"] == owner, f"{name}: port {p['name']} is declared on {c['name']}, not {owner}"
            assert flag(c["args"], port_flag) == str(p["containerPort"]), (
                f"{name}: {owner} --{port_flag} is not containerPort {p['name']} ({p['containerPort']})"
            )
    declared = {p["name"] for c in (container(spec, "router"), container(spec, "worker")) for p in c.get("ports", [])}
    assert {"grpc", "http", "metrics-router", "metrics-worker", "health-worker"} <= declared, name


def test_deployment_and_job_selectors_pick_their_own_pods(server_rendering, renderings):
    name, r = server_rendering
    server, convert, _ = _cluster(renderings, name)
    deployment = r.one("Deployment", "colibri")
    assert selects(deployment["spec"]["selector"], server.labels), f"{name}: the Deployment selects no pod of its own"
    assert not selects(deployment["spec"]["selector"], convert.labels), f"{name}: the Deployment adopts the Job's pod"
    spread = pod_spec(deployment)["topologySpreadConstraints"]
    assert all(selects(t["labelSelector"], server.labels) for t in spread), f"{name}: spreads pods it does not count"


def test_services_send_to_the_server_pods_only(server_rendering, renderings):
    name, r = server_rendering
    server, convert, _ = _cluster(renderings, name)
    for svc in r.of_kind("Service"):
        where = f"{name}: Service {svc['metadata']['name']}"
        assert service_selects(svc, server), f"{where} has no endpoints"
        assert not service_selects(svc, convert), f"{where} sends traffic to the convert Job"
        for sp in svc["spec"]["ports"]:
            port = target_port(sp, server)
            assert port is not None, (
                f"{where} port {sp['name']}: targetPort {sp.get('targetPort')} is no container port (a sidecar's "
                "port names resolve only from Kubernetes 1.32: give its number)"
            )
            assert PORTS[port.name][2] is not None, f"{where} exposes the kubelet's {port.name} port"


def test_every_exposed_port_is_reachable_through_service_and_policy(server_rendering, renderings):
    name, r = server_rendering
    server, _, policies = _cluster(renderings, name)
    service = r.one("Service", "colibri")
    for port in server.ports:
        who = PORTS[port.name][2]
        if who is None:
            assert not any(target_port(sp, server) == port for s in r.of_kind("Service") for sp in s["spec"]["ports"])
            assert not connection_allowed(policies, CLIENT, server, port.name), f"{name}: {port.name} is open"
            continue
        assert any(target_port(sp, server) == port for sp in service["spec"]["ports"]), (
            f"{name}: Service colibri has no port for {port.name}"
        )
        assert connection_allowed(policies, who, server, port.name), (
            f"{name}: the NetworkPolicy blocks {who.name} ({who.namespace}) -> {port.name} ({port.number})"
        )
    # Metrics are for the monitoring namespace only.
    for metrics in ("metrics-router", "metrics-worker"):
        assert not connection_allowed(policies, CLIENT, server, metrics), f"{name}: {metrics} open to clients"


def test_every_policy_port_is_a_declared_port(server_rendering):
    """No rule opens a port nothing listens on (a stale rule hides a missing one)."""
    name, r = server_rendering
    (server,) = workload_pods(r)
    for rule in r.one("NetworkPolicy", "colibri")["spec"]["ingress"]:
        for p in rule["ports"]:
            assert server.port(p["port"]), f"{name}: the policy opens {p['port']}, which no container declares"


def test_dns_resolves_under_the_policies(server_rendering, renderings):
    """Whatever shape the cluster's resolver has: kube-dns, CoreDNS under another label, NodeLocal DNSCache."""
    name, _ = server_rendering
    server, convert, policies = _cluster(renderings, name)
    for pod in (server, convert):
        for resolver in RESOLVERS:
            for port in resolver.ports:
                assert connection_allowed(policies, pod, resolver, port.number, port.protocol), (
                    f"{name}: {pod.name} cannot reach {resolver.name} on {port.number}/{port.protocol}"
                )
        assert not connection_allowed(policies, pod, KUBE_DNS, 8080), f"{name}: {pod.name} reaches kube-dns:8080"


def test_egress_beyond_dns(server_rendering, renderings):
    name, _ = server_rendering
    server, convert, policies = _cluster(renderings, name)
    assert connection_allowed(policies, server, OTLP_COLLECTOR, "otlp-grpc"), f"{name}: traces cannot leave"
    assert not connection_allowed(policies, server, HUB, "https"), f"{name}: the servers need no Internet"
    assert connection_allowed(policies, convert, HUB, "https"), "the convert Job cannot download from the Hub"
    assert not any(connection_allowed(policies, CLIENT, convert, p) for p in (50051, 8000, 9090)), (
        "nothing may connect to the convert Job"
    )


def test_each_policy_isolates_exactly_its_pods(server_rendering, renderings):
    name, _ = server_rendering
    server, convert, policies = _cluster(renderings, name)
    by_name = {p["metadata"]["name"]: p["spec"]["podSelector"] for p in policies}
    assert selects(by_name["colibri"], server.labels) and not selects(by_name["colibri"], convert.labels), name
    convert_policy = by_name["colibri-convert"]
    assert selects(convert_policy, convert.labels) and not selects(convert_policy, server.labels), name


def test_pdb_counts_the_server_pods_only(server_rendering, renderings):
    name, r = server_rendering
    server, convert, _ = _cluster(renderings, name)
    selector = r.one("PodDisruptionBudget", "colibri")["spec"]["selector"]
    assert selects(selector, server.labels) and not selects(selector, convert.labels), name


def test_hpa_scales_the_server_deployment(renderings):
    for name in ("production", "cpu+hpa"):
        r = renderings[name]
        target = r.one("HorizontalPodAutoscaler", "colibri")["spec"]["scaleTargetRef"]
        deployment = r.one("Deployment", target["name"])
        assert (target["apiVersion"], target["kind"]) == (deployment["apiVersion"], deployment["kind"]), name


def test_podmonitor_scrapes_every_metrics_port_of_the_server_pods(renderings):
    for name in ("production", "cpu+monitoring"):
        r = renderings[name]
        server, convert, _ = _cluster(renderings, name)
        monitor = r.one("PodMonitor", "colibri")
        spec = monitor["spec"]
        namespaces = spec.get("namespaceSelector", {}).get("matchNames", [monitor["metadata"]["namespace"]])
        assert server.namespace in namespaces, f"{name}: the PodMonitor looks in {namespaces}"
        assert selects(spec["selector"], server.labels) and not selects(spec["selector"], convert.labels), name
        scraped = {e["port"] for e in spec["podMetricsEndpoints"]}
        metrics_ports = {p.name for p in server.ports if PORTS[p.name][2] is PROMETHEUS}
        assert scraped == metrics_ports, f"{name}: scrapes {sorted(scraped)}, the pod serves {sorted(metrics_ports)}"
        # The job label the alerts and the dashboard select on comes from a label every server pod has.
        assert spec["jobLabel"] in server.labels, f"{name}: jobLabel {spec['jobLabel']} is not a pod label"


def test_model_volume_attaches_to_every_pod_that_mounts_it_at_once(server_rendering, renderings):
    """The servers (up to the HPA's maximum, plus a rollout's surge pod) and the convert Job, which writes,
    mount one claim and may land on different nodes: a ReadWriteOnce volume attaches to one node only, and
    the next pod waits on Multi-Attach forever."""
    name, r = server_rendering
    deployment = r.one("Deployment", "colibri")
    hpas = r.of_kind("HorizontalPodAutoscaler")
    replicas = hpas[0]["spec"]["maxReplicas"] if hpas else deployment["spec"]["replicas"]
    surge = deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
    job_spec = pod_spec(renderings["convert"].one("Job", "colibri-convert"))
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for spec in (pod_spec(deployment), job_spec)
        for v in spec["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert claims == {"colibri-models"}, f"{name}: the Job and the servers must share the model claim: {claims}"
    job_writes = any(m["name"] == "models" and not m.get("readOnly") for m in job_spec["containers"][0]["volumeMounts"])
    assert job_writes, f"{name}: the convert Job writes the model"
    modes = r.one("PersistentVolumeClaim", "colibri-models")["spec"]["accessModes"]
    assert modes == ["ReadWriteMany"], f"{name}: {replicas + surge} servers and a writing Job on one {modes} volume"
