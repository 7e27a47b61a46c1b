"""A small OpenAI-like server with chosen defects, so that the tests of tools/fuzz_http.py and
tools/soak.py can show that each of their checks fails when it should."""
from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

SPEC = {
    "openapi": "3.1.0",
    "info": {"title": "defective", "version": "0"},
    "paths": {"/v1/completions": {"post": {
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["prompt"],
            "properties": {"prompt": {"type": "string"}, "max_tokens": {"type": "integer", "minimum": 1},
                           "stream": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1}}}}}},
        "responses": {
            "200": {"description": "ok", "content": {"application/json": {"schema": {
                "type": "object", "required": ["choices"], "properties": {"choices": {"type": "array"}}}}}},
            "400": {"description": "bad", "content": {"application/json": {"schema": {"type": "object"}}}},
            "500": {"description": "documented, still a failure", "content": {"application/json": {
                "schema": {"type": "object"}}}}}}}},
}
CHUNK = {"object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
LAST = {"object": "text_completion", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}


class DefectiveServer:
    """defects: a set of "server_error" (n=2 -> 500), "plain_errors" (400s as text/plain),
    "unterminated_stream" (no data: [DONE]), "leak" (/metrics: one block never freed)."""

    def __init__(self, defects: set[str]):
        self.defects = defects
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            if "plain_errors" in self.defects:
                return web.Response(status=400, text="bad request")
            return web.json_response({"error": {"message": "bad", "type": "invalid_request_error",
                                                "param": None, "code": None}}, status=400)
        if body.get("n") == 2 and "server_error" in self.defects:
            return web.json_response({"error": {"message": "boom", "type": "server_error",
                                                "param": None, "code": None}}, status=500)
        if body.get("stream") is not True:
            return web.json_response(LAST)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in [CHUNK] * 3 + [LAST]:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.01)
        if "unterminated_stream" not in self.defects:
            await response.write(b"data: [DONE]\n\n")
        return response

    async def metrics(self, request: web.Request) -> web.Response:
        free = 9 if "leak" in self.defects else 10
        text = (f"ember:num_requests_running 0\nember:num_requests_waiting 0\n"
                f"ember:kv_cache_free_blocks {free}\nember:kv_cache_total_blocks 10\n")
        return web.Response(text=text)

    def _app(self) -> web.Application:
        def constant(body):
            async def handler(request):
                return web.json_response(body)
            return handler

        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/openapi.json", constant(SPEC))
        app.router.add_get("/health", constant({"status": "ready"}))
        app.router.add_get("/v1/models", constant({"data": [{"id": "fake"}]}))
        app.router.add_get("/metrics", self.metrics)
        return app

    def __enter__(self) -> DefectiveServer:
        async def start():
            self.runner = web.AppRunner(self._app())
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
