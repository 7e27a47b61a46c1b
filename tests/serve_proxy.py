"""A stand-in for Ray Serve's HTTP proxy in front of the ingress, for tests without a Ray cluster:
uvicorn on loopback (the proxy's server) calling OpenAIIngress.__call__ as Serve's replica does
(a starlette Request; the returned Response run as an ASGI app) and cancelling the call when the
client disconnects (Serve's direct-ingress path: ray/serve/_private/replica.py)."""
from __future__ import annotations

import asyncio

import uvicorn
from starlette.requests import Request


def serve_like_ray(ingress):
    """The ASGI app Serve makes of an ingress deployment's __call__."""
    async def app(scope, receive, send):
        messages: asyncio.Queue = asyncio.Queue()

        async def until_disconnect():
            while True:
                message = await receive()
                await messages.put(message)
                if message["type"] == "http.disconnect":
                    return

        async def call():
            response = await ingress(Request(scope, messages.get, send))
            await response(scope, messages.get, send)

        request_task, receive_task = asyncio.ensure_future(call()), asyncio.ensure_future(until_disconnect())
        done, _ = await asyncio.wait({request_task, receive_task}, return_when=asyncio.FIRST_COMPLETED)
        if request_task in done:
            receive_task.cancel()
            await request_task
        else:
            request_task.cancel()
    return app


class ProxyServer:
    """uvicorn serving serve_like_ray(ingress) on 127.0.0.1; start() and stop() on the ingress's loop."""

    def __init__(self, ingress):
        config = uvicorn.Config(serve_like_ray(ingress), host="127.0.0.1", port=0, lifespan="off",
                                log_level="warning", loop="none")
        self.server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> str:
        self._task = asyncio.ensure_future(self.server.serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        await self._task
