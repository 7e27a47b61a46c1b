"""Prometheus metrics, one registry per server, served under two prefixes: `ember:` and `vllm:`.

Every series is defined once, with vLLM's name and meaning, under `ember:`; /metrics also serves
each one renamed to `vllm:` (plus the older vLLM names that dashboards and gateways still read,
e.g. `vllm:gpu_cache_usage_perc`), so a vLLM Grafana board, llm-d's scheduler or KServe reads this
server unchanged. Labels: `model_name` (the first served name) and `engine` ("0": one engine core).

Gauge semantics (what Kubernetes inference gateways route on):
- num_requests_running: sequences in the running batch (n > 1 counts each of its sequences, as
  vLLM v1 counts the child requests it splits n into);
- num_requests_waiting: requests queued in the scheduler, not yet started or preempted;
- kv_cache_usage_perc: a fraction 0..1 (not a percentage, as in vLLM) of KV blocks referenced by a
  sequence; blocks held only by the prefix cache are evictable and count as free.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the API)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import Metric

from ember_cupy.engine_client import SchedulerStats, SpecDecodeCounts

OWN_PREFIX = "ember:"
VLLM_PREFIX = "vllm:"
ENGINE_INDEX = "0"
# Names vLLM used before v1 (or beside it) that dashboards and gateways still read.
VLLM_ALIASES = {
    "kv_cache_usage_perc": ("gpu_cache_usage_perc",),
    "inter_token_latency_seconds": ("time_per_output_token_seconds",),
    "prefix_cache_queries": ("gpu_prefix_cache_queries",),
    "prefix_cache_hits": ("gpu_prefix_cache_hits",),
}

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


class EngineMetrics:
    """All server metrics, labelled with the served model name, in a private CollectorRegistry
    so that several servers can live in one process."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self._exposition = CollectorRegistry(auto_describe=False)
        self._exposition.register(_VllmMirror(self.registry))
        self._define_state_series()
        self._define_request_series()
        self._prefix_seen = (0, 0)
        self._spec_seen = None

    # --- definitions ------------------------------------------------------------------
    def _labelled(self, kind, name: str, doc: str, extra: tuple[str, ...] = (), **kwargs):
        metric = kind(OWN_PREFIX + name, doc, ["model_name", "engine", *extra], registry=self.registry, **kwargs)
        return metric if extra else metric.labels(self.model_name, ENGINE_INDEX)

    def _define_state_series(self) -> None:
        gauge = lambda name, doc: self._labelled(Gauge, name, doc)   # noqa: E731
        self.num_requests_running = gauge("num_requests_running",
                                          "Sequences in the running batch (prefill or decode).")
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Requests queued in the scheduler (new or preempted).")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc",
                                         "Fraction 0..1 of KV-cache blocks referenced by a sequence.")
        self.kv_cache_free_blocks = gauge("kv_cache_free_blocks",
                                          "KV-cache blocks not referenced by any sequence "
                                          "(blocks kept only by the prefix cache count as free).")
        self.kv_cache_total_blocks = gauge("kv_cache_total_blocks", "KV-cache blocks in the pool.")
        self.engine_ready = gauge("engine_ready", "1 when the engine is loaded and its loop is alive.")
        self._cache_config_info = self._labelled(
            Gauge, "cache_config_info", "KV-cache configuration, in the labels (value 1).",
            extra=("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"))

    def _define_request_series(self) -> None:
        counter = lambda name, doc: self._labelled(Counter, name, doc)   # noqa: E731

        def histogram(name, doc, buckets):
            return self._labelled(Histogram, name, doc, buckets=buckets)

        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self._success = self._labelled(Counter, "request_success", "Finished requests by finish reason.",
                                       extra=("finished_reason",))
        self.requests_rejected = counter("request_rejected", "Requests refused because the queue was full.")
        self.iteration_tokens = histogram("iteration_tokens_total",
                                          "Tokens (prompt and generated) computed per engine step.",
                                          _STEP_TOKEN_BUCKETS)
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Arrival to first generated token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between consecutive tokens of a sequence.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Arrival to finish of a request.", _LATENCY_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Arrival to first scheduling of a request.", _LATENCY_BUCKETS)
        self.request_inference_time = histogram("request_inference_time_seconds",
                                                "First scheduling to last token of a request.",
                                                _LATENCY_BUCKETS)
        self.request_prefill_time = histogram("request_prefill_time_seconds",
                                              "First scheduling to first token of a request.",
                                              _LATENCY_BUCKETS)
        self.request_decode_time = histogram("request_decode_time_seconds",
                                             "First token to last token of a request.", _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt length of finished requests.",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens of finished requests.", _TOKEN_BUCKETS)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "The most tokens one completion of a finished request generated "
            "(its n completions' maximum).", _TOKEN_BUCKETS)
        self.request_params_n = histogram("request_params_n", "The n of finished requests.", _N_BUCKETS)
        self.request_params_max_tokens = histogram("request_params_max_tokens",
                                                   "The max_tokens of finished requests (those that set one).",
                                                   _TOKEN_BUCKETS)

    # --- updates --------------------------------------------------------------------------
    def request_finished(self, reason: str | None) -> None:
        self._success.labels(self.model_name, ENGINE_INDEX, reason or "unknown").inc()

    def request_timings(self, stats) -> None:
        """The phase histograms from a finished request's SequenceStats (merged over its n)."""
        if stats.queue_time is not None:
            self.request_queue_time.observe(max(0.0, stats.queue_time))
        if stats.first_scheduled_time is not None and stats.last_token_time is not None:
            self.request_inference_time.observe(max(0.0, stats.last_token_time - stats.first_scheduled_time))
        if stats.prefill_time is not None:
            self.request_prefill_time.observe(max(0.0, stats.prefill_time))
        if stats.first_token_time is not None and stats.last_token_time is not None:
            self.request_decode_time.observe(max(0.0, stats.last_token_time - stats.first_token_time))
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)

    def request_params(self, params) -> None:
        self.request_params_n.observe(params.n)
        if params.max_tokens is not None:
            self.request_params_max_tokens.observe(params.max_tokens)

    def step_computed(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.iteration_tokens.observe(num_tokens)

    def watch(self, stats: Callable[[], SchedulerStats], ready: Callable[[], bool]) -> None:
        """Serve the state gauges from the engine's latest published SchedulerStats, read when
        /metrics is scraped (so a step being computed shows as running)."""
        self.num_requests_running.set_function(lambda: stats().num_running)
        self.num_requests_waiting.set_function(lambda: stats().num_waiting)
        self.kv_cache_usage_perc.set_function(lambda: stats().kv_cache_usage)
        self.kv_cache_free_blocks.set_function(lambda: stats().num_free_blocks)
        self.kv_cache_total_blocks.set_function(lambda: stats().num_blocks)
        self.engine_ready.set_function(lambda: 1.0 if ready() else 0.0)

    def count_engine_totals(self, stats: SchedulerStats) -> None:
        """The counters of the engine's cumulative counts (prefix cache, speculative decoding)."""
        queries, hits = self._prefix_seen
        if stats.prefix_cache_queries >= queries and stats.prefix_cache_hits >= hits:
            self.prefix_cache_queries.inc(stats.prefix_cache_queries - queries)
            self.prefix_cache_hits.inc(stats.prefix_cache_hits - hits)
        self._prefix_seen = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        self._count_spec_decode(stats.spec_decode)

    def _define_spec_decode_series(self) -> None:
        """vLLM's spec_decode_* counters, served (as in vLLM) only when speculation is configured."""
        counter = lambda name, doc: self._labelled(Counter, name, doc)   # noqa: E731
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts",
                                              "Speculative decoding: verifications (a sequence's drafts in a step).")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_decode_accepted_per_pos = self._labelled(
            Counter, "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position (from 0).",
            extra=("position",))

    def _count_spec_decode(self, stats: SpecDecodeCounts | None) -> None:
        if stats is None:
            return
        if self._spec_seen is None:
            self._define_spec_decode_series()
        seen = self._spec_seen or (0, 0, 0, [0] * len(stats.accepted_per_position))
        now = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.accepted_per_position))
        self.spec_decode_num_drafts.inc(now[0] - seen[0])
        self.spec_decode_num_draft_tokens.inc(now[1] - seen[1])
        self.spec_decode_num_accepted_tokens.inc(now[2] - seen[2])
        for position, (count, before) in enumerate(zip(now[3], seen[3])):
            self._spec_decode_accepted_per_pos.labels(self.model_name, ENGINE_INDEX, str(position)).inc(count - before)
        self._spec_seen = now

    def set_cache_config(self, block_size: int, num_blocks: int, dtype: str, prefix_caching: bool) -> None:
        self._cache_config_info.labels(self.model_name, ENGINE_INDEX, str(block_size), str(num_blocks), dtype,
                                       str(prefix_caching).lower()).set(1)

    def render(self) -> bytes:
        return generate_latest(self._exposition)


class _VllmMirror:
    """A collector yielding each family of `source` as it is and again under vLLM's names."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self):
        for family in self.source.collect():
            yield family
            base = family.name.removeprefix(OWN_PREFIX)
            for name in (base, *VLLM_ALIASES.get(base, ())):
                yield _renamed(family, VLLM_PREFIX + name)


def _renamed(family: Metric, name: str) -> Metric:
    copy = Metric(name, family.documentation, family.type, family.unit)
    copy.samples = [s._replace(name=name + s.name[len(family.name):]) for s in family.samples]
    return copy
