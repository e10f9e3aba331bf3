"""The monitoring component as rendered: the alert rules and the Grafana dashboard query only what the
processes export. The exported series are derived from common/metrics.py (each process's registry built as
the services build it, every labelled family given a series), so a renamed metric or label fails here; the
label values the queries select (job, container, endpoint, outcome, kind) are checked against the rendered
PodMonitor and pod and against the code's allowed values."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from common.metrics import OUTCOMES, STEP_KINDS, RouterMetrics, WorkerMetrics, new_registry
from tests.deploy.cluster import workload_pods
from tests.deploy.k8s import find_tool

promql_parser = pytest.importorskip(
    "promql_parser", reason="promql-parser is not installed (it parses the PromQL of the alerts and the dashboard)"
)

MONITORED = ("cpu+monitoring", "production")
# Labels Prometheus adds to every series of a PodMonitor target; `up` carries only these.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "endpoint"}
# Series that are not the processes' own: Prometheus writes `up` for every target it scrapes.
SCRAPE_SERIES = {"up": set()}
# Grafana's interval macros, replaced by a duration so that the expression parses as PromQL.
GRAFANA_INTERVALS = ("$__rate_interval", "$__interval", "$__range")
# Label values the code restricts (common/metrics.py raises on any other).
ALLOWED_VALUES = {"outcome": set(OUTCOMES), "kind": set(STEP_KINDS)}
REQUIRED_ALERTS = {
    "ColibriWorkerDown",
    "ColibriQueueGrowing",
    "ColibriTimeToFirstTokenHigh",
    "ColibriInterTokenLatencyHigh",
    "ColibriKVCacheNearlyFull",
    "ColibriExpertCacheStalling",
    "ColibriRestarting",
}


def exported_series() -> dict[str, set[str]]:
    """Sample name (with its _total, _bucket, _sum, _count suffix) -> label names, over both processes."""
    router_registry, worker_registry = new_registry(), new_registry()
    router = RouterMetrics(router_registry, "m")
    router.observe_step("decode", 0.01, 0.009, 1, 1)
    worker = WorkerMetrics(worker_registry, "m")
    worker.worker_step_duration.labels(kind="decode").observe(0.01)
    worker.set_load_imbalance([[1, 2]])
    worker.set_memory_plan({"kv_cache": 1})
    series: dict[str, set[str]] = {}
    for registry in (router_registry, worker_registry):
        for family in registry.collect():
            assert family.samples, f"{family.name} has no series: give it one above so its labels are known"
            for sample in family.samples:
                series.setdefault(sample.name, set()).update(sample.labels)
    return series


EXPORTED = exported_series()


def _rules(r) -> list[dict]:
    return [rule for group in r.one("PrometheusRule", "colibri")["spec"]["groups"] for rule in group["rules"]]


def _dashboard(r) -> dict:
    config_map = [c for c in r.of_kind("ConfigMap") if (c["metadata"].get("labels") or {}).get("grafana_dashboard")]
    assert len(config_map) == 1, f"{r.name}: one ConfigMap for Grafana's dashboard sidecar"
    (text,) = config_map[0]["data"].values()
    return json.loads(text)


def _panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' nested panels included."""
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every variable query (the selector inside label_values)."""
    queries = [
        (f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in _panels(dashboard) for t in p.get("targets", [])
    ]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), *(\w+)\)", v["query"]["query"])
            assert m, f"variable {v['name']}: not a label_values(selector, label) query"
            queries.append((f"variable {v['name']}", m.group(1)))
    return queries


def _all_queries(r) -> list[tuple[str, str]]:
    return [(f"alert {rule['alert']}", rule["expr"]) for rule in _rules(r)] + _dashboard_queries(_dashboard(r))


def _selectors(expr: str) -> list:
    for macro in GRAFANA_INTERVALS:
        expr = expr.replace(macro, "5m")
    found = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def _alternatives(matcher) -> set[str] | None:
    """The values an = or =~ matcher accepts when it is a plain alternation (a|b|c); None otherwise."""
    op = str(matcher.op)
    if op.endswith("Equal") and not op.endswith("NotEqual"):
        return {matcher.value}
    if op.endswith("Re") and re.fullmatch(r"[\w|]+", matcher.value):
        return set(matcher.value.split("|"))
    return None


@pytest.fixture(params=MONITORED)
def monitored(request, renderings):
    return renderings[request.param]


def test_every_query_names_only_exported_series_and_labels(monitored):
    r = monitored
    (server,) = workload_pods(r)
    monitor = r.one("PodMonitor", "colibri")["spec"]
    known_values = {
        "job": {server.labels[monitor["jobLabel"]]},
        "endpoint": {e["port"] for e in monitor["podMetricsEndpoints"]},
        "container": {c for c in ("router", "worker")},
        **ALLOWED_VALUES,
    }
    queries = _all_queries(r)
    assert len(queries) >= 30, f"{r.name}: {len(queries)} queries found"
    for where, expr in queries:
        selectors = _selectors(expr)
        assert selectors, f"{where}: no metric in {expr!r}"
        for s in selectors:
            assert s.name in EXPORTED or s.name in SCRAPE_SERIES, (
                f"{where}: {s.name} is exported by neither process (common/metrics.py): {expr!r}"
            )
            labels = EXPORTED.get(s.name, SCRAPE_SERIES.get(s.name, set())) | TARGET_LABELS
            for m in s.matchers.matchers:
                assert m.name in labels, f"{where}: {s.name} has no label {m.name!r} (it has {sorted(labels)})"
                values = _alternatives(m)
                if m.name in known_values and values and "$" not in m.value:
                    assert values <= known_values[m.name], (
                        f"{where}: {m.name}={m.value!r}, but {s.name} only ever has {sorted(known_values[m.name])}"
                    )


def test_histogram_quantiles_read_buckets_by_le(monitored):
    """histogram_quantile over anything but a _bucket series aggregated with `le` kept returns nothing."""
    for where, expr in _all_queries(monitored):
        for m in re.finditer(r"histogram_quantile\(\s*[\d.]+,\s*sum by \(([^)]*)\) \(rate\((\w+)\{", expr):
            assert "le" in [x.strip() for x in m.group(1).split(",")], f"{where}: `le` dropped in {expr!r}"
            assert m.group(2).endswith("_bucket"), f"{where}: {m.group(2)} is not a histogram's buckets"


def test_alert_rules(monitored):
    rules = _rules(monitored)
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), "alert names repeat"
    assert REQUIRED_ALERTS <= set(names), f"missing alerts: {sorted(REQUIRED_ALERTS - set(names))}"
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]


def test_prometheus_selects_the_monitor_and_the_rules(monitored):
    """kube-prometheus-stack selects PodMonitors and rules by one label: both carry the same value."""
    monitor = monitored.one("PodMonitor", "colibri")["metadata"]["labels"]
    rule = monitored.one("PrometheusRule", "colibri")["metadata"]["labels"]
    assert monitor.get("release") and monitor["release"] == rule.get("release"), monitored.name


def test_dashboard_is_well_formed(monitored):
    dashboard = _dashboard(monitored)
    panels = _panels(dashboard)
    assert len({p["id"] for p in panels}) == len(panels), "panel ids repeat"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert "datasource" in variables
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, f"panel {p['title']!r} is wider than the grid"
        area = {(g["x"] + i, g["y"] + j) for i in range(g["w"]) for j in range(g["h"])}
        assert not cells & area, f"panel {p['title']!r} overlaps another"
        cells |= area
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", f"panel {p['title']!r} is bound to one data source"
        assert p["targets"] and p.get("description"), p["title"]
    for where, expr in _dashboard_queries(dashboard):
        for used in re.findall(r"\$(\w+)", expr):
            assert used in variables or f"${used}" in GRAFANA_INTERVALS, f"{where}: ${used} is not a variable"


def test_hpa_metric_is_exported(renderings):
    for name in ("production", "cpu+hpa"):
        for m in renderings[name].one("HorizontalPodAutoscaler", "colibri")["spec"]["metrics"]:
            assert m["pods"]["metric"]["name"] in EXPORTED, f"{name}: the HPA scales on a metric nobody exports"


def test_promtool_accepts_the_rules(renderings, tmp_path):
    promtool = find_tool("promtool", env="COLIBRI_PROMTOOL")
    if promtool is None:
        pytest.skip("promtool not found (COLIBRI_PROMTOOL or PATH; Debian's prometheus package ships it)")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(renderings["production"].one("PrometheusRule", "colibri")["spec"]))
    proc = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
