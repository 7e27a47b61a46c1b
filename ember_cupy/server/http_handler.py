"""Errors of aiohttp's HTTP layer itself (a bad request line, a bad chunk size, Transfer-Encoding
with Content-Length, an over-long header) in OpenAI's JSON shape, logged as one line.

aiohttp answers those before any middleware runs, from RequestHandler.handle_error: plain text,
and an ERROR traceback whose message echoes up to 8 KB of the client's bytes. Server() builds a
RequestHandler per connection, so the runner's Server gets a subclass that builds ours.
"""
from __future__ import annotations

import logging
import re

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError

from ember_cupy.server.errors import APIError

log = logging.getLogger("ember_cupy.server")

_BYTES_ECHO = re.compile(r"""\s*b(['"]).*""")   # aiohttp quotes the offending bytes as b'...'
_MAX_REASON = 160


def describe_parse_error(exc: BaseException) -> str:
    """`BadStatusLine: Bad status line: Expected CRLF after version`: the exception's text without
    the client's bytes or the caret line under them, on one line, ASCII, at most 160 characters."""
    text = getattr(exc, "message", None) or str(exc)
    parts = []
    for line in str(text).splitlines():
        line = _BYTES_ECHO.sub("", line).strip().rstrip(":.").strip()
        if line and set(line) != {"^"}:
            parts.append(line)
    reason = ": ".join(parts) or "malformed request"
    reason = f"{type(exc).__name__}: {reason}".encode("ascii", "backslashreplace").decode()
    return reason if len(reason) <= _MAX_REASON else reason[:_MAX_REASON - 3] + "..."


def error_response(request, status: int = 500, exc: BaseException | None = None) -> web.StreamResponse:
    """aiohttp's RequestHandler.handle_error in OpenAI's shape: the answer to an error past every
    middleware (also the Ray ingress's, which calls the app without a connection)."""
    if request.writer.output_size > 0:   # as aiohttp: too late for another response
        raise ConnectionError("Response is sent already, cannot send another response "
                              "with the error message")
    if isinstance(exc, HttpProcessingError):
        reason = describe_parse_error(exc)
        log.warning("bad HTTP request from %s: %s", request.remote, reason)
        error = APIError(400, f"malformed HTTP request: {reason}", code="bad_http_request")
    elif isinstance(exc, ConnectionError):   # the client left (e.g. mid-body): nobody to answer
        log.debug("client %s went away during %s %s: %s", request.remote, request.method,
                  request.path, type(exc).__name__)
        error = APIError(499, "client closed the connection", code="client_closed")
    elif status == 504:
        log.warning("request handler timed out: %s %s", request.method, request.path)
        error = APIError(504, "the request handler timed out", code="timeout")
    else:   # an exception past every middleware: a bug, so keep its traceback
        log.error("unhandled error handling a request from %s", request.remote, exc_info=exc)
        error = APIError(500, "internal server error", code="internal_error")
    response = error.response()
    response.force_close()
    return response


class JSONErrorRequestHandler(web_protocol.RequestHandler):
    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        return error_response(request, status, exc)


class _Server(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return JSONErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class AppRunner(web.AppRunner):
    """web.AppRunner whose connections use JSONErrorRequestHandler."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server   # same state; only __call__ differs
        return server
