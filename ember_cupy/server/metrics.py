"""Prometheus metrics with vLLM's names under an `ember:` prefix, one registry per server."""
from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the API)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class EngineMetrics:
    """All server metrics, labelled with the served model name, in a private CollectorRegistry
    so that several servers can live in one process."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"ember:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"ember:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"ember:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Sequences being computed (prefill or decode).")
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 0..1.")
        self.kv_cache_free_blocks = gauge("kv_cache_free_blocks",
                                          "KV-cache blocks not referenced by any sequence "
                                          "(blocks kept only by the prefix cache count as free).")
        self.kv_cache_total_blocks = gauge("kv_cache_total_blocks", "KV-cache blocks in the pool.")
        self.engine_ready = gauge("engine_ready", "1 when the engine is loaded and its loop is alive.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self._success = Counter("ember:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.requests_rejected = counter("request_rejected", "Requests refused because the queue was full.")
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Arrival to first generated token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between consecutive tokens of a sequence.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Arrival to finish of a request.", _LATENCY_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Arrival to first scheduling of a request.", _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt length of finished requests.",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens of finished requests.", _TOKEN_BUCKETS)
        self._prefix_seen = (0, 0)

    def request_finished(self, reason: str | None) -> None:
        self._success.labels(self.model_name, reason or "unknown").inc()

    def update_engine_state(self, engine) -> None:
        """Gauges and cumulative counters from the engine; call between steps only."""
        bm = engine.block_manager
        self.num_requests_running.set(engine.num_running)
        self.num_requests_waiting.set(engine.num_waiting)
        self.kv_cache_usage_perc.set(bm.usage)
        self.kv_cache_free_blocks.set(bm.num_free_blocks)
        self.kv_cache_total_blocks.set(bm.num_blocks)
        stats = bm.prefix_stats
        queries, hits = self._prefix_seen
        if stats.queries >= queries and stats.hits >= hits:
            self.prefix_cache_queries.inc(stats.queries - queries)
            self.prefix_cache_hits.inc(stats.hits - hits)
        self._prefix_seen = (stats.queries, stats.hits)

    def render(self) -> bytes:
        return generate_latest(self.registry)
