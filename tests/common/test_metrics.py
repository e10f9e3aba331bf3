import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.metrics import (
    GENAI_TPOT_BUCKETS,
    OUTCOMES,
    REQUEST_DURATION_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    RouterMetrics,
    WorkerMetrics,
    load_imbalance,
    new_registry,
    start_metrics_server,
)

# Every metric of docs/observability.md, with its Prometheus type, and the process it lives in.
ROUTER = {
    "colibri_requests": "counter",
    "colibri_queue_size": "gauge",
    "colibri_num_requests_running": "gauge",
    "colibri_num_requests_waiting": "gauge",
    "colibri_time_to_first_token_seconds": "histogram",
    "colibri_time_per_output_token_seconds": "histogram",
    "colibri_request_duration_seconds": "histogram",
    "colibri_request_queue_duration_seconds": "histogram",
    "colibri_prompt_tokens": "counter",
    "colibri_generation_tokens": "counter",
    "colibri_batch_size": "histogram",
    "colibri_batch_tokens": "histogram",
    "colibri_step_duration_seconds": "histogram",
    "colibri_step_transport_overhead_seconds": "histogram",
    "colibri_prefix_cache_queries": "counter",
    "colibri_prefix_cache_hits": "counter",
    "colibri_prefix_cache_evictions": "counter",
    "colibri_prefix_cache_blocks": "gauge",
    "colibri_http_connections": "gauge",
    "colibri_http_connections_refused": "counter",
    "colibri_http_body_bytes": "gauge",
    "colibri_http_bodies_refused": "counter",
}
WORKER = {
    "colibri_worker_step_duration_seconds": "histogram",
    "colibri_kv_cache_usage_ratio": "gauge",
    "colibri_kv_blocks_used": "gauge",
    "colibri_expert_cache_hits": "counter",
    "colibri_expert_cache_misses": "counter",
    "colibri_expert_cache_copied_bytes": "counter",
    "colibri_expert_cache_stall_seconds": "counter",
    "colibri_expert_cache_step_stall_seconds": "histogram",
    "colibri_expert_cache_prefetches_issued": "counter",
    "colibri_expert_cache_prefetches_used": "counter",
    "colibri_routing_plan_recall": "gauge",
    "colibri_routing_plan_recall_per_step": "histogram",
    "colibri_expert_load_imbalance": "gauge",
    "colibri_worker_memory_plan_bytes": "gauge",
}


def scrape(registry) -> dict:
    server = start_metrics_server(registry, 0, host="127.0.0.1")
    port = server.server_port
    try:
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200
            text = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    return {f.name: f for f in text_string_to_metric_families(text)}


def buckets(family, **labels) -> list[float]:
    return [
        float(s.labels["le"])
        for s in family.samples
        if s.name.endswith("_bucket")
        and all(s.labels.get(k) == v for k, v in labels.items())
        and s.labels["le"] != "+Inf"
    ]


def test_router_scrape_has_every_metric_with_model_name():
    registry = new_registry()
    m = RouterMetrics(registry, "tiny-mixtral")
    m.observe_step("prefill", router_seconds=0.020, worker_seconds=0.018, num_seqs=2, num_tokens=300)
    m.observe_step("decode", router_seconds=0.004, worker_seconds=0.0045, num_seqs=2, num_tokens=2)
    m.observe_finished("ok", 1.5)
    m.time_to_first_token.observe(0.03)
    m.time_per_output_token.observe(0.004)
    m.request_queue_duration.observe(0.001)
    m.prompt_tokens.inc(300)
    m.generation_tokens.inc(2)
    m.queue_size.set(3)
    m.num_requests_running.set(2)
    m.num_requests_waiting.set(1)
    families = scrape(registry)
    for name, kind in ROUTER.items():
        assert name in families, name
        fam = families[name]
        assert fam.type == kind, name
        assert fam.samples and all(s.labels["model_name"] == "tiny-mixtral" for s in fam.samples), name
    assert not set(WORKER) & set(families)  # each metric lives in one process only
    assert "process_resident_memory_bytes" in families

    outcomes = {
        s.labels["outcome"]: s.value for s in families["colibri_requests"].samples if s.name == "colibri_requests_total"
    }
    assert outcomes == {o: (1.0 if o == "ok" else 0.0) for o in OUTCOMES}  # all outcomes exist from the start
    overhead = families["colibri_step_transport_overhead_seconds"]
    sums = {s.labels["kind"]: s.value for s in overhead.samples if s.name.endswith("_sum")}
    assert sums["prefill"] == pytest.approx(0.002) and sums["decode"] == 0.0  # negative jitter clamps to 0


def test_genai_bucket_boundaries():
    registry = new_registry(process_metrics=False)
    m = RouterMetrics(registry, "m")
    m.time_to_first_token.observe(0.1)
    m.time_per_output_token.observe(0.1)
    m.request_duration.observe(0.1)
    families = scrape(registry)
    assert buckets(families["colibri_time_to_first_token_seconds"]) == list(TTFT_BUCKETS)
    assert buckets(families["colibri_request_duration_seconds"]) == list(REQUEST_DURATION_BUCKETS)
    tpot = buckets(families["colibri_time_per_output_token_seconds"])
    assert tpot == list(TPOT_BUCKETS) and set(GENAI_TPOT_BUCKETS) <= set(tpot)
    assert TTFT_BUCKETS == (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
    assert REQUEST_DURATION_BUCKETS == tuple(0.01 * 2**i for i in range(14))
    assert GENAI_TPOT_BUCKETS == (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def test_worker_scrape_has_every_metric_with_model_name():
    registry = new_registry()
    m = WorkerMetrics(registry, "tiny-mixtral")
    m.worker_step_duration.labels(kind="decode").observe(0.003)
    m.set_kv_usage(blocks_used=25, num_blocks=100)
    m.observe_expert_cache(
        hits=10, misses=2, copied_bytes=4096, stall_seconds=0.001, prefetches_issued=3, prefetches_used=2
    )
    m.observe_recall(0.9)
    m.set_load_imbalance([[4, 0, 0, 0], [1, 1, 1, 1]])
    m.set_memory_plan({"dense_weights": 1 << 20, "kv_cache": 1 << 30})
    families = scrape(registry)
    for name, kind in WORKER.items():
        assert name in families, name
        fam = families[name]
        assert fam.type == kind, name
        assert fam.samples and all(s.labels["model_name"] == "tiny-mixtral" for s in fam.samples), name
    assert not set(ROUTER) & set(families)
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert values[("colibri_kv_cache_usage_ratio", (("model_name", "tiny-mixtral"),))] == 0.25
    imbalance = {s.labels["layer"]: s.value for s in families["colibri_expert_load_imbalance"].samples}
    assert imbalance == {"0": 4.0, "1": 1.0}
    plan = {s.labels["item"]: s.value for s in families["colibri_worker_memory_plan_bytes"].samples}
    assert plan == {"dense_weights": 2**20, "kv_cache": 2**30}
    assert families["colibri_expert_cache_copied_bytes"].samples[0].value == 4096
    assert families["colibri_expert_cache_prefetches_used"].samples[0].value == 2


def test_fixed_labels_are_checked_and_registries_are_independent():
    m1 = RouterMetrics(new_registry(process_metrics=False), "a")
    m2 = RouterMetrics(new_registry(process_metrics=False), "b")  # a second set must not clash
    with pytest.raises(ValueError, match="outcome"):
        m1.requests.labels(outcome="okay")
    with pytest.raises(ValueError, match="kind"):
        m2.step_duration.labels(kind="verify")


def test_load_imbalance():
    assert load_imbalance([2, 2, 2, 2]) == 1.0
    assert load_imbalance([8, 0, 0, 0]) == 4.0
    assert load_imbalance([0, 0]) == 1.0 and load_imbalance([]) == 1.0
