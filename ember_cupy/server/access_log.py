"""The access log: one line per HTTP request on the `ember_cupy.server.access` logger, at info
level (debug for the /health and /metrics probes): client, method, path, status, the request's
prompt and generated tokens, latency. Never a prompt's or a reply's text.

Token counts reach the line through a context variable: the middleware sets a RequestUsage for
the request's task, AsyncEngine.add_request (called from that task) hands it to the engine loop,
which adds each output's tokens to it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass

from aiohttp import web

ACCESS_LOG = logging.getLogger("ember_cupy.server.access")
PROBE_PATHS = ("/health", "/metrics")
CLIENT_CLOSED = 499   # nginx's status for a client that left before the response was complete


@dataclass
class RequestUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


_current_usage: ContextVar[RequestUsage | None] = ContextVar("ember_request_usage", default=None)


def current_usage() -> RequestUsage | None:
    """The token counts of the HTTP request being handled in this task, if any."""
    return _current_usage.get()


def access_log_middleware():
    @web.middleware
    async def access_log(request: web.Request, handler):
        usage = RequestUsage()
        token = _current_usage.set(usage)
        start = time.monotonic()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionError):
            status = CLIENT_CLOSED
            raise
        finally:
            _current_usage.reset(token)
            level = logging.DEBUG if request.path in PROBE_PATHS else logging.INFO
            ACCESS_LOG.log(level, "%s %s %s %d prompt_tokens=%d completion_tokens=%d %.3fs",
                           request.remote or "-", request.method, request.path, status,
                           usage.prompt_tokens, usage.completion_tokens, time.monotonic() - start)
    return access_log
