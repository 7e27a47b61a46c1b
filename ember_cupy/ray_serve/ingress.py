"""The OpenAI ingress deployment: the project's own aiohttp app, behind Serve's HTTP proxy.

Why the server's app and not a second API: ember_cupy.server's handlers read aiohttp requests and
write aiohttp (SSE) responses, so the ingress builds that very app (build_app) over a RemoteEngine
and hands it each starlette Request Serve's proxy gives it, in this process (in_process_app.py: no
socket, no HTTP client, no connection limit but Serve's own max_ongoing_requests). Every route,
error body, middleware and response shape is the plain server's, by construction.

/health and /metrics are the ingress's own (not the app's): they ask every live engine replica
(Serve's handle.broadcast) and answer for all of them (fleet_health.py, fleet_metrics.py).

A client that goes away: Serve cancels __call__ (or the streaming of its response), which cancels
the app's handler, whose streams close, which cancels the Ray streaming calls, which abort the
requests on their replicas.
"""
from __future__ import annotations

from ray.serve.exceptions import DeploymentUnavailableError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember_cupy.ray_serve.fleet_health import summarize_health
from ember_cupy.ray_serve.fleet_metrics import merge_expositions
from ember_cupy.ray_serve.in_process_app import InProcessApp
from ember_cupy.ray_serve.remote_engine import RemoteEngine
from ember_cupy.server.api import ServerSettings, build_app, wait_engine_started
from ember_cupy.server.metrics import CONTENT_TYPE_LATEST
from ember_cupy.server.prepare_workers import DEFAULT_PREPARE_TIMEOUT

PROBE_TIMEOUT_S = 10.0   # for every replica to answer a /health or /metrics fan-out
MAX_ONGOING_REQUESTS = 1024   # the ingress's Serve limit (app.py): requests one ingress replica serves at once


class OpenAIIngress:
    """Ray Serve deployment class (app.py wraps it in serve.deployment)."""

    async def __init__(self, engine_handle, model: str | None = None, server_settings: dict | None = None,
                       prepare_timeout: float = DEFAULT_PREPARE_TIMEOUT):
        self.engine = RemoteEngine(engine_handle, model, prepare_timeout=prepare_timeout)
        settings = ServerSettings(**{**(server_settings or {}), "model_path": model})
        self.app = InProcessApp(build_app(self.engine, settings), settings.max_body_bytes)
        await self.app.start()
        await wait_engine_started(self.app.app)
        self.fleet_routes = {"/health": self.health, "/metrics": self.metrics}

    async def __call__(self, request: Request) -> Response:
        fleet_route = self.fleet_routes.get(request.url.path) if request.method == "GET" else None
        if fleet_route is not None and self.engine.is_ready:
            return await fleet_route()
        return await self.app(request)

    async def health(self) -> JSONResponse:
        status, body = summarize_health(await self._ask_replicas("health_report"))
        return JSONResponse(body, status_code=status)

    async def metrics(self) -> Response:
        reports = [r for r in await self._ask_replicas("metrics_report") if isinstance(r, dict)]
        return Response(merge_expositions({r["replica_id"]: r["text"] for r in reports}),
                        media_type=CONTENT_TYPE_LATEST)

    async def _ask_replicas(self, method: str) -> list:
        """Every live replica's answer to `method`, or the exception it (or the fan-out) raised."""
        try:
            return await self.engine.handle.broadcast(method).results_async(
                timeout_s=PROBE_TIMEOUT_S, return_exceptions=True)
        except DeploymentUnavailableError:
            return []
        except TimeoutError:
            return [TimeoutError(f"the replicas did not all answer within {PROBE_TIMEOUT_S:g} s")]

    def check_health(self) -> None:
        if not self.engine.is_ready:
            raise RuntimeError(self.engine.error or f"the ingress engine is {self.engine.state.value}")

    async def stop(self) -> None:
        """Shut the app down (the RemoteEngine closes its streams): for tests and embedding."""
        await self.app.stop()
