"""The rendered objects placed in a model cluster, to ask what they do rather than what they say: which pods a
label selector picks, which Service port reaches which container port, and whether the NetworkPolicies let a
connection through. Kubernetes' own rules, written out for the subset the manifests use (matchLabels and
matchExpressions, named and numbered ports, pod and namespace peers), as the oldest supported version (1.29)
applies them where versions differ.

The model cluster holds the pods a real one has around ours: the cluster's resolver in each of its usual shapes
(kube-dns in kube-system, `k8s-app: kube-dns`, the label CoreDNS keeps on kubeadm, EKS, GKE and AKS; CoreDNS under
a label of its own, as some installs deploy it; NodeLocal DNSCache, answering on a link-local address of the node,
which no pod selector names), Prometheus in the `monitoring` namespace, an API client in another namespace, an OTLP
collector, and an address outside the cluster (the Hugging Face Hub).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tests.deploy.k8s import Rendering, all_containers, pod_spec


@dataclass(frozen=True)
class Port:
    name: str | None
    number: int
    protocol: str = "TCP"
    sidecar: bool = False  # declared by a native sidecar (an init container with restartPolicy: Always)


@dataclass(frozen=True)
class Pod:
    """A pod (or a destination outside the cluster, namespace None) with the labels policies select on."""

    name: str
    namespace: str | None
    labels: Mapping[str, str] = field(default_factory=dict)
    ports: tuple[Port, ...] = ()

    @property
    def namespace_labels(self) -> dict[str, str]:
        # Kubernetes >= 1.22 labels every namespace with its own name.
        return {"kubernetes.io/metadata.name": self.namespace} if self.namespace else {}

    def port(self, name_or_number: str | int) -> Port | None:
        for p in self.ports:
            if name_or_number in (p.name, p.number):
                return p
        return None


DNS_PORTS = (Port("dns", 53, "UDP"), Port("dns-tcp", 53))
KUBE_DNS = Pod("coredns", "kube-system", {"k8s-app": "kube-dns"}, DNS_PORTS)
COREDNS_OWN_LABEL = Pod("coredns-own-label", "kube-system", {"app.kubernetes.io/name": "coredns"}, DNS_PORTS)
NODE_LOCAL_DNS = Pod("node-local-dns 169.254.20.10", None, ports=DNS_PORTS)  # the node's, not a pod's, address
RESOLVERS = (KUBE_DNS, COREDNS_OWN_LABEL, NODE_LOCAL_DNS)
PROMETHEUS = Pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"})
CLIENT = Pod("api-client", "apps", {"app": "api-client"})
OTLP_COLLECTOR = Pod("otel-collector", "observability", {"app": "otel-collector"}, (Port("otlp-grpc", 4317),))
HUB = Pod("huggingface.co", None, ports=(Port("https", 443),))


def workload_pods(rendering: Rendering) -> list[Pod]:
    """The pod each Deployment or Job of a rendering creates, with the container ports it declares."""
    pods = []
    for obj in rendering.of_kind("Deployment") + rendering.of_kind("Job"):
        ports = tuple(
            Port(p.get("name"), p["containerPort"], p.get("protocol", "TCP"), c.get("restartPolicy") == "Always")
            for c in all_containers(pod_spec(obj))
            for p in c.get("ports", [])
        )
        pods.append(
            Pod(
                f"{obj['kind']}/{obj['metadata']['name']}",
                obj["metadata"]["namespace"],
                obj["spec"]["template"]["metadata"].get("labels", {}),
                ports,
            )
        )
    return pods


def selects(selector: Mapping | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against a set of labels; {} selects everything."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": present and value in e.get("values", []),
            "NotIn": not present or value not in e.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]
        if not ok:
            return False
    return True


def service_selects(service: dict, pod: Pod) -> bool:
    """A Service's selector is a plain map (no expressions) and only picks pods of its own namespace."""
    selector = service["spec"].get("selector")
    return (
        bool(selector)
        and pod.namespace == service["metadata"]["namespace"]
        and selects({"matchLabels": selector}, pod.labels)
    )


def target_port(service_port: dict, pod: Pod) -> Port | None:
    """The container port of `pod` a Service port sends to (targetPort by name or number; default: port).

    A name is looked up in the pod's regular containers only: the endpoint controllers of Kubernetes before
    1.32 do not see a native sidecar's named ports, and leave such a Service port without endpoints."""
    target = service_port.get("targetPort", service_port["port"])
    if isinstance(target, str):
        found = next((p for p in pod.ports if p.name == target and not p.sidecar), None)
    else:
        found = pod.port(target)
    return found if found and found.protocol == service_port.get("protocol", "TCP") else None


def _policy_types(policy: dict) -> set[str]:
    spec = policy["spec"]
    return set(spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else [])))


def _peer_matches(peer: dict, policy_namespace: str, pod: Pod) -> bool:
    if pod.namespace is None:  # outside the cluster: only ipBlock peers could name it
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], pod.namespace_labels):
            return False
    elif pod.namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector", {}), pod.labels)


def _port_matches(rule_ports: list[dict] | None, destination: Pod, port: Port) -> bool:
    if not rule_ports:
        return True
    for rp in rule_ports:
        if rp.get("protocol", "TCP") != port.protocol:
            continue
        wanted = rp.get("port")
        if wanted is None:
            return True
        if isinstance(wanted, str):  # a named port: the destination pod's port of that name
            named = destination.port(wanted)
            if named and named.number == port.number:
                return True
        elif wanted <= port.number <= rp.get("endPort", wanted):
            return True
    return False


def _side_allows(policies: Iterable[dict], pod: Pod, direction: str, peer: Pod, destination: Pod, port: Port) -> bool:
    """Whether the policies that select `pod` for `direction` (Ingress or Egress) let the connection pass."""
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    isolating = [
        p
        for p in policies
        if p["metadata"]["namespace"] == pod.namespace
        and direction in _policy_types(p)
        and selects(p["spec"]["podSelector"], pod.labels)
    ]
    if not isolating:
        return True  # a pod no policy selects is not isolated
    for policy in isolating:
        for rule in policy["spec"].get(key) or []:
            peers = rule.get(peers_key)
            if (
                not peers or any(_peer_matches(p, policy["metadata"]["namespace"], peer) for p in peers)
            ) and _port_matches(rule.get("ports"), destination, port):
                return True
    return False


def connection_allowed(
    policies: list[dict], source: Pod, destination: Pod, port: int | str, protocol: str = "TCP"
) -> bool:
    """Egress from `source` and ingress to `destination` on `port` (a number, or a port name of `destination`)."""
    if isinstance(port, str):
        resolved = destination.port(port)
        assert resolved is not None, f"{destination.name} has no port named {port}"
    else:
        resolved = Port(None, port, protocol)
    return _side_allows(policies, source, "Egress", destination, destination, resolved) and (
        destination.namespace is None or _side_allows(policies, destination, "Ingress", source, destination, resolved)
    )
