"""InProcessApp on a bare aiohttp app (no middlewares): what aiohttp's connection handler would do
with what gets past them (an exception, a raised redirect), and a compressed stream."""
from __future__ import annotations

import asyncio
import json
import zlib

import pytest

pytest.importorskip("starlette", reason="needs the ray extra: pip install 'ember-cupy[ray]'")

from aiohttp import web  # noqa: E402
from starlette.requests import Request  # noqa: E402

from ember_cupy.ray_serve.in_process_app import InProcessApp  # noqa: E402


async def _boom(request):
    raise KeyError("a bug")


async def _moved(request):
    raise web.HTTPFound("/elsewhere")


async def _deflated(request):
    response = web.StreamResponse()
    response.enable_compression(force=web.ContentCoding.deflate)
    await response.prepare(request)
    for part in (b"data: one\n\n", b"data: two\n\n"):
        await response.write(part)
    return response


def _ask(path: str) -> tuple[int, dict, bytes]:
    app = web.Application()
    app.router.add_get("/boom", _boom)
    app.router.add_get("/moved", _moved)
    app.router.add_get("/deflated", _deflated)

    async def run():
        served = InProcessApp(app, max_body_bytes=1024)
        await served.start()
        scope = {"type": "http", "http_version": "1.1", "method": "GET", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "headers": [], "client": ("10.0.0.7", 1)}
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)
        try:
            response = await served(Request(scope, receive))
            await response({**scope, "asgi": {"spec_version": "2.4"}}, receive, send)
        finally:
            await served.stop()
        return (sent[0]["status"], {k.decode(): v.decode() for k, v in sent[0]["headers"]},
                b"".join(m.get("body", b"") for m in sent[1:]))
    return asyncio.run(run())


def test_an_exception_past_every_middleware_is_the_servers_json_500():
    status, headers, body = _ask("/boom")
    assert status == 500 and headers["content-type"].startswith("application/json")
    assert json.loads(body)["error"]["code"] == "internal_error"


def test_a_raised_redirect_is_answered_as_aiohttp_answers_it():
    status, headers, _ = _ask("/moved")
    assert status == 302 and headers["location"] == "/elsewhere"


def test_a_compressed_stream_arrives_compressed():
    status, headers, body = _ask("/deflated")
    assert status == 200 and headers["content-encoding"] == "deflate"
    assert zlib.decompress(body) == b"data: one\n\ndata: two\n\n"
