"""The Ray application's /health and /metrics answers from its replicas' reports (no Ray needed:
tests/test_ray_serve.py drives the same code through a live cluster)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ember_cupy.ray_serve.fleet_health import summarize_health
from ember_cupy.ray_serve.fleet_metrics import merge_expositions
from ember_cupy.server.metrics import EngineMetrics


def _replica_text(finished: int, running: int) -> str:
    metrics = EngineMetrics("m")
    for _ in range(finished):
        metrics.request_finished("length")
    metrics.num_requests_running.set(running)
    return metrics.render().decode()


def _samples(text: str, name: str) -> dict[str, float]:
    return {s.labels["replica"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def test_metrics_keep_each_replicas_series_under_a_replica_label():
    merged = merge_expositions({"b": _replica_text(3, 1), "a": _replica_text(2, 0)}).decode()
    for prefix in ("ember:", "vllm:"):
        assert _samples(merged, prefix + "request_success_total") == {"a": 2.0, "b": 3.0}
        assert _samples(merged, prefix + "num_requests_running") == {"a": 0.0, "b": 1.0}
    assert merged.count("# TYPE ember:request_success_total counter") == 1   # one family, both replicas
    assert 'ember:request_success_total{engine="0",finished_reason="length",model_name="m",replica="a"} 2.0' in merged
    buckets = [s for f in text_string_to_metric_families(merged) for s in f.samples
               if s.name == "ember:e2e_request_latency_seconds_bucket"]
    assert {s.labels["replica"] for s in buckets} == {"a", "b"}


def test_metrics_of_no_replica_are_empty():
    assert merge_expositions({}) == b""


def test_health_is_ready_only_when_every_replica_is():
    ready = [{"replica_id": i, "state": "ready", "error": None} for i in ("r2", "r1")]
    status, body = summarize_health(ready)
    assert status == 200 and body["status"] == "ready"
    assert [r["replica_id"] for r in body["replicas"]] == ["r1", "r2"]
    status, body = summarize_health([ready[0], RuntimeError("actor died\nTraceback ...")])
    assert status == 200 and body["status"] == "degraded"
    assert {"replica_id": None, "state": "unreachable", "error": "RuntimeError: actor died"} in body["replicas"]


def test_health_is_503_when_no_replica_is_ready():
    status, body = summarize_health([{"replica_id": "r1", "state": "dead", "error": "boom"},
                                     {"replica_id": "r2", "state": "loading", "error": None}])
    assert status == 503 and body["status"] == "not_ready" and len(body["replicas"]) == 2
    assert body["error"]["type"] == "service_unavailable_error" and "dead, loading" in body["error"]["message"]
    status, body = summarize_health([])
    assert status == 503 and body["status"] == "unreachable" and body["replicas"] == []
