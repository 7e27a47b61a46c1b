"""The OpenAI ingress deployment: the project's own aiohttp app, behind Serve's HTTP proxy.

Why a loopback app and not a second API: ember_cupy.server's handlers read aiohttp requests and
write aiohttp (SSE) responses, so the ingress runs that very app (build_app via Server, on
127.0.0.1 in this replica's event loop) over a RemoteEngine, and __call__ relays each HTTP request
Serve's proxy hands it to that app and streams the answer back. Every route, error body,
middleware and response shape is the plain server's, by construction.

/health and /metrics are the ingress's own (not relayed): they ask every live engine replica
(Serve's handle.broadcast) and answer for all of them (fleet_health.py, fleet_metrics.py).

A client that goes away: Serve cancels __call__, the relay closes its loopback connection, the
app's handler is cancelled (handler_cancellation), its streams close, which cancels the Ray
streaming calls, which abort the requests on their replicas.
"""
from __future__ import annotations

import aiohttp
from ray.serve.exceptions import DeploymentUnavailableError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ember_cupy.ray_serve.fleet_health import summarize_health
from ember_cupy.ray_serve.fleet_metrics import merge_expositions
from ember_cupy.ray_serve.remote_engine import RemoteEngine
from ember_cupy.server.api import ServerSettings
from ember_cupy.server.launcher import Server
from ember_cupy.server.prepare_workers import DEFAULT_PREPARE_TIMEOUT
from ember_cupy.server.metrics import CONTENT_TYPE_LATEST

# Hop-by-hop headers (RFC 9110 7.6.1) and the framing the relay re-does.
_NOT_RELAYED = {"connection", "keep-alive", "transfer-encoding", "upgrade", "proxy-connection",
                "te", "trailer", "content-length", "host"}
PROBE_TIMEOUT_S = 10.0   # for every replica to answer a /health or /metrics fan-out
MAX_ONGOING_REQUESTS = 1024   # the ingress's Serve limit (app.py), and so its loopback connections


class OpenAIIngress:
    """Ray Serve deployment class (app.py wraps it in serve.deployment)."""

    async def __init__(self, engine_handle, model: str | None = None, server_settings: dict | None = None,
                       max_ongoing_requests: int = MAX_ONGOING_REQUESTS,
                       prepare_timeout: float = DEFAULT_PREPARE_TIMEOUT):
        self.engine = RemoteEngine(engine_handle, model, prepare_timeout=prepare_timeout)
        settings = ServerSettings(**{**(server_settings or {}), "host": "127.0.0.1", "port": 0,
                                     "model_path": model})
        self.server = Server(self.engine, settings)
        await self.server.start()
        await self.server.wait_ready()
        self.base_url = f"http://127.0.0.1:{self.server.port}"
        self.session = _relay_session(max_ongoing_requests)
        self.fleet_routes = {"/health": self.health, "/metrics": self.metrics}

    async def __call__(self, request: Request) -> Response:
        fleet_route = self.fleet_routes.get(request.url.path) if request.method == "GET" else None
        if fleet_route is not None and self.engine.is_ready:
            return await fleet_route()
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_RELAYED}
        url = self.base_url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        upstream = await self.session.request(request.method, url, headers=headers, data=body,
                                              allow_redirects=False)
        return StreamingResponse(_relay(upstream), status_code=upstream.status,
                                 headers={k: v for k, v in upstream.headers.items()
                                          if k.lower() not in _NOT_RELAYED})

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


def _relay_session(max_connections: int) -> aiohttp.ClientSession:
    """One loopback connection for each request Serve may hand this replica at once (aiohttp's
    default of 100 would queue the rest); no total timeout: a stream lasts as long as its
    generation, and the app bounds the rest."""
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=max_connections)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                 timeout=aiohttp.ClientTimeout(total=None))


async def _relay(upstream: aiohttp.ClientResponse):
    try:
        async for chunk in upstream.content.iter_any():
            yield chunk
    finally:
        upstream.close()   # early (a cancelled relay): drops the loopback connection
