"""The OpenAI ingress deployment: the project's own aiohttp app, behind Serve's HTTP proxy.

Why a loopback app and not a second API: ember_cupy.server's handlers read aiohttp requests and
write aiohttp (SSE) responses, so the ingress runs that very app (build_app via Server, on
127.0.0.1 in this replica's event loop) over a RemoteEngine, and __call__ relays each HTTP request
Serve's proxy hands it to that app and streams the answer back. Every route, error body,
middleware and response shape is the plain server's, by construction.

A client that goes away: Serve cancels __call__, the relay closes its loopback connection, the
app's handler is cancelled (handler_cancellation), its streams close, which cancels the Ray
streaming calls, which abort the requests on their replicas.
"""
from __future__ import annotations

import aiohttp
from starlette.requests import Request
from starlette.responses import StreamingResponse

from ember_cupy.ray_serve.remote_engine import RemoteEngine
from ember_cupy.server.api import ServerSettings
from ember_cupy.server.launcher import Server

# Hop-by-hop headers (RFC 9110 7.6.1) and the framing the relay re-does.
_NOT_RELAYED = {"connection", "keep-alive", "transfer-encoding", "upgrade", "proxy-connection",
                "te", "trailer", "content-length", "host"}


class OpenAIIngress:
    """Ray Serve deployment class (app.py wraps it in serve.deployment)."""

    async def __init__(self, engine_handle, model: str | None = None, server_settings: dict | None = None):
        self.engine = RemoteEngine(engine_handle, model)
        settings = ServerSettings(**{**(server_settings or {}), "host": "127.0.0.1", "port": 0,
                                     "model_path": model})
        self.server = Server(self.engine, settings)
        await self.server.start()
        await self.server.wait_ready()
        self.base_url = f"http://127.0.0.1:{self.server.port}"
        # no total timeout: a stream lasts as long as its generation; the app bounds the rest
        self.session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))

    async def __call__(self, request: Request) -> StreamingResponse:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_RELAYED}
        url = self.base_url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        upstream = await self.session.request(request.method, url, headers=headers, data=body,
                                              allow_redirects=False)
        return StreamingResponse(_relay(upstream), status_code=upstream.status,
                                 headers={k: v for k, v in upstream.headers.items()
                                          if k.lower() not in _NOT_RELAYED})

    def check_health(self) -> None:
        if not self.engine.is_ready:
            raise RuntimeError(self.engine.error or f"the ingress engine is {self.engine.state.value}")


async def _relay(upstream: aiohttp.ClientResponse):
    try:
        async for chunk in upstream.content.iter_any():
            yield chunk
    finally:
        upstream.close()   # early (a cancelled relay): drops the loopback connection
