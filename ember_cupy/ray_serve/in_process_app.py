"""An aiohttp application answering starlette requests in this process: no socket, no HTTP client.

The Ray ingress serves ember_cupy.server's app (its routes, middlewares, error bodies, SSE) to the
requests Serve's proxy hands it as starlette Requests. Each one becomes an aiohttp Request made by
the app's own request factory, with a payload writer of ours, and goes to the app's own request
handler (middlewares, then the route): what aiohttp's RequestHandler does for a connection, minus
the parsing and the socket. The writer hands the status line, headers and each body chunk to a
starlette StreamingResponse as they are written, so a streamed answer stays streamed.

A client that goes away: Serve cancels the call (or starlette the streaming), and the handler's
task is cancelled with it, as aiohttp's handler_cancellation does when a connection is lost.
"""
from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http import HttpVersion
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from multidict import CIMultiDict, CIMultiDictProxy
from starlette.requests import Request
from starlette.responses import StreamingResponse
from yarl import URL

from ember_cupy.ray_serve.response_capture import ResponseCapture
from ember_cupy.server.http_handler import error_response

# Hop-by-hop headers (RFC 9110 7.6.1) and the framing Serve's proxy does itself.
NOT_FORWARDED = frozenset({"connection", "keep-alive", "transfer-encoding", "upgrade", "proxy-connection",
                           "te", "trailer", "content-length"})
_PAYLOAD_LIMIT = 2 ** 16   # aiohttp's own StreamReader limit for a connection


class _Peer(BaseProtocol):
    """What an aiohttp Request reads of its connection: the client's and our addresses."""

    max_field_size = max_line_length = 8190   # aiohttp's defaults, for multipart bodies
    max_headers = 128
    ssl_context = None

    def __init__(self, loop, client, server):
        super().__init__(loop)
        self.peername = tuple(client) if client else None
        self.sockname = tuple(server) if server else None

    def pause_reading(self) -> None:
        """Nothing to pause: the body is fed whole, before the handler reads it."""

    def resume_reading(self, resume_parser: bool = True) -> None:
        """Nothing was paused."""


class InProcessApp:
    """`await start()`, then `await app(starlette_request)` for each request; `await stop()`."""

    def __init__(self, app: web.Application, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._runner = web.AppRunner(app)   # setup() runs on_startup and freezes; it binds nothing

    async def start(self) -> None:
        await self._runner.setup()

    async def stop(self) -> None:
        await self._runner.cleanup()   # on_shutdown, on_cleanup (the engine's shutdown)

    async def __call__(self, request: Request) -> StreamingResponse:
        body = await _read_body(request, self.max_body_bytes)
        peer = _Peer(asyncio.get_running_loop(), request.client, request.scope.get("server"))
        capture = ResponseCapture()
        handling = asyncio.get_running_loop().create_task(
            self._respond(_message(request), _payload(peer, body), peer, capture))
        handling.add_done_callback(capture.close)
        try:
            status, headers = await capture.head()
        except BaseException:
            handling.cancel()   # cancelled before the head: the client left
            raise
        response = StreamingResponse(_forward(capture, handling), status_code=status)
        response.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                for k, v in headers.items() if k.lower() not in NOT_FORWARDED]
        return response

    async def _respond(self, message: RawRequestMessage, payload: StreamReader, peer: _Peer,
                       capture: ResponseCapture) -> None:
        """aiohttp's RequestHandler._handle_request and finish_response, for one request."""
        server = self._runner.server
        request = server.request_factory(message, payload, peer, capture, asyncio.current_task())
        try:
            response = await server.request_handler(request)
        except web.HTTPException as exc:
            response = exc
        except asyncio.TimeoutError:
            response = error_response(request, 504)
        except Exception as exc:  # noqa: BLE001 - past every middleware, as aiohttp answers it
            response = error_response(request, 500, exc)
        await response.prepare(request)
        await response.write_eof()


async def _read_body(request: Request, max_body_bytes: int) -> bytes:
    """The body, or its first max_body_bytes + 1 bytes: enough for the app's 413, no more held."""
    chunks, size = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > max_body_bytes:
            break
    return b"".join(chunks)


def _payload(peer: _Peer, body: bytes) -> StreamReader:
    """The body as aiohttp's parser would hand it on: all of it there, then the end."""
    if not body:
        return EMPTY_PAYLOAD
    payload = StreamReader(peer, _PAYLOAD_LIMIT, loop=asyncio.get_running_loop())
    payload.feed_data(body)
    payload.feed_eof()
    return payload


def _message(request: Request) -> RawRequestMessage:
    """The request line and headers as aiohttp's parser gives them."""
    raw = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
    headers = CIMultiDictProxy(CIMultiDict(raw))
    path = (request.scope.get("raw_path") or request.url.path.encode()).decode("latin-1")
    query = request.scope.get("query_string", b"").decode("latin-1")
    path += f"?{query}" if query else ""
    major, _, minor = request.scope.get("http_version", "1.1").partition(".")
    version = HttpVersion(int(major), int(minor or 0))
    closing = headers.get("Connection", "").lower() == "close" or version < HttpVersion(1, 1)
    return RawRequestMessage(request.method, path, version, headers, tuple(request.headers.raw), closing,
                             None, False, "chunked" in headers.get("Transfer-Encoding", "").lower(),
                             URL(path, encoded=True))


async def _forward(capture: ResponseCapture, handling: asyncio.Task):
    """The body chunks as the app writes them; the handler is cancelled if this stops early."""
    try:
        async for chunk in capture.chunks():
            yield chunk
    finally:
        if not handling.done():
            handling.cancel()
