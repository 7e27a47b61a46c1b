"""The engine deployment: each replica owns one AsyncEngine and serves generate/abort over Ray.

generate() is a streaming method: its first item says whether the engine admitted the request
(so the ingress can answer 4xx/503 before any SSE byte goes out), then come the engine's delta
outputs. When the caller cancels the stream (a client that went away), Ray cancels this
generator, and its finally closes the request's stream: the engine aborts it and frees its blocks.
"""
from __future__ import annotations

import os

from ray import serve

from ember_cupy.config import EngineConfig
from ember_cupy.sampling_params import SamplingParams
from ember_cupy.server.async_engine import (DEFAULT_STREAM_STALL_TIMEOUT, AsyncEngine, EngineDeadError,
                                            EngineNotReadyError, EngineOverloadedError)
from ember_cupy.server.metrics import EngineMetrics
from ember_cupy.server.prepare_workers import DEFAULT_PREPARE_TIMEOUT, PrepareTimeoutError

# What generate() yields first: admission, or the error the ingress re-raises as the same class.
ADMITTED = "admitted"
REFUSED = "refused"
OUTPUT = "output"
ADMISSION_ERRORS = {cls.__name__: cls for cls in
                    (ValueError, EngineOverloadedError, PrepareTimeoutError, EngineNotReadyError, EngineDeadError)}


def _load_engine(model: str | None, config: EngineConfig):
    from ember_cupy.engine.llm_engine import LLMEngine
    return LLMEngine(model, config)


class EngineReplica:
    """Ray Serve deployment class (app.py wraps it in serve.deployment with its options)."""

    async def __init__(self, model: str | None = None, engine_config: dict | None = None,
                       served_model_name: str = "model", max_waiting: int | None = None,
                       stream_stall_timeout: float = DEFAULT_STREAM_STALL_TIMEOUT,
                       prepare_timeout: float = DEFAULT_PREPARE_TIMEOUT):
        config = EngineConfig(**(engine_config or {}))
        self.engine = AsyncEngine(factory=lambda: _load_engine(model, config),
                                  metrics=EngineMetrics(served_model_name), max_waiting=max_waiting,
                                  stream_stall_timeout=stream_stall_timeout, prepare_timeout=prepare_timeout)
        await self.engine.start()
        self.requests_admitted = 0
        self.requests_cancelled = 0   # by their caller before finishing (a client that went away)

    async def generate(self, prompt, params: SamplingParams, *, request_id: str, priority: int = 0,
                       cache_salt: str | None = None, prompt_token_ids: list[int] | None = None,
                       prompt_index: int = 0, routing_key=None):
        """(ADMITTED, None) then (OUTPUT, delta RequestOutput)...; or one (REFUSED, (class, message)).
        prompt_token_ids, prompt_index: as AsyncEngine.add_request's (the ingress tokenized the
        prompt; its place among its HTTP request's prompts). routing_key is the router's
        (prefix_router.py), unused here."""
        try:
            stream = await self.engine.add_request(prompt, params, request_id=request_id, priority=priority,
                                                   cache_salt=cache_salt, prompt_token_ids=prompt_token_ids,
                                                   prompt_index=prompt_index)
        except tuple(ADMISSION_ERRORS.values()) as exc:
            yield REFUSED, (type(exc).__name__, str(exc))
            return
        self.requests_admitted += 1
        try:
            yield ADMITTED, None
            async for output in stream:
                yield OUTPUT, output
        finally:
            if not stream.finished:
                self.requests_cancelled += 1
            stream.close()

    def info(self) -> dict:
        """What the ingress needs of the engine: its model_info (the EngineClient contract's)."""
        return {"model_info": self.engine.model_info()}

    def record_routing_stats(self) -> dict:
        """Serve polls this for the router (request_routing_stats_period_s): the engine's own queues."""
        stats = self.engine.scheduler_stats   # a published snapshot: safe while a step runs
        return {"num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "num_in_flight": self.engine.num_in_flight,
                "num_free_blocks": stats.num_free_blocks, "kv_cache_blocks": stats.num_blocks,
                "requests_admitted": self.requests_admitted, "requests_cancelled": self.requests_cancelled,
                "replica_id": _replica_id(), "pid": os.getpid()}

    def health_report(self) -> dict:
        """This replica's entry in the application's /health (fleet_health.py)."""
        return {"replica_id": _replica_id(), "state": self.engine.state.value, "error": self.engine.error,
                "num_in_flight": self.engine.num_in_flight}

    def metrics_report(self) -> dict:
        """This replica's Prometheus text, for the application's /metrics (fleet_metrics.py)."""
        return {"replica_id": _replica_id(), "text": self.engine.metrics.render().decode()}

    def check_health(self) -> None:
        """Serve's health check: a dead engine loop fails it, and Serve replaces the replica."""
        if not self.engine.is_ready:
            raise RuntimeError(self.engine.error or f"the engine is {self.engine.state.value}")


def _replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id
