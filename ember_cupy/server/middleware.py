"""aiohttp middlewares: OpenAI-shaped errors (Anthropic's on /v1/messages, Ollama's on /api/), API-key
auth, opt-in CORS."""
from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web

from ember_cupy.server import anthropic_errors, ollama_errors
from ember_cupy.server.errors import APIError, bad_request, from_http_exception

log = logging.getLogger("ember_cupy.server")

# With an API key these need "Authorization: Bearer <key>" or Anthropic's "x-api-key: <key>"; every
# other route (/health, /metrics, /version, /openapi.json, the / and /docs pages: probes, scrapers,
# docs) stays public. cli/serve_flags.py's --api-key help and README.md list both.
PROTECTED_PREFIXES = ("/v1/", "/api/", "/tokenize", "/detokenize", "/completion", "/apply-template", "/props",
                      "/models/")   # the router's /models/load and /models/unload


def error_middleware():
    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as exc:
            return _response(request, exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _response(request, from_http_exception(exc))
        except (asyncio.CancelledError, ConnectionError):
            raise
        except RecursionError:   # nested input that slipped past the body's depth check
            log.warning("recursion limit hit in %s %s", request.method, request.path)
            return _response(request, bad_request("request is nested too deeply", code="invalid_json"))
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return _response(request, APIError(500, "internal server error", code="internal_error"))
    return errors


def _response(request: web.Request, error: APIError) -> web.Response:
    if anthropic_errors.speaks_anthropic(request.path):
        return error.response(anthropic_errors.error_body(error))
    if ollama_errors.speaks_ollama(request.path):
        return error.response(ollama_errors.error_body(error))
    return error.response()


def _bearer_token(header: str) -> bytes | None:
    """The credentials of `Bearer <token>`; the scheme is case-insensitive (RFC 7235)."""
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode("utf-8", "surrogateescape")


def auth_middleware(api_key: str):
    expected = api_key.encode()

    @web.middleware
    async def auth(request: web.Request, handler):
        if request.method != "OPTIONS" and request.path.startswith(PROTECTED_PREFIXES):
            header = request.headers.get("Authorization", "")
            api_key = request.headers.get("x-api-key")   # Anthropic's header: its SDK sends only this
            if header:
                token = _bearer_token(header)
            else:
                token = api_key.encode("utf-8", "surrogateescape") if api_key is not None else None
            if token is None or not hmac.compare_digest(token, expected):
                message = ("missing API key: expected 'Authorization: Bearer <api key>' or 'x-api-key: <api key>'"
                           if not header and api_key is None
                           else "the Authorization header must be 'Bearer <api key>'" if token is None
                           else "invalid API key")
                raise APIError(401, message, code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)
    return auth


def cors_handlers(allowed_origins: list[str]):
    """(middleware answering preflights, on_response_prepare signal adding the allow header).
    The header is added on prepare so streamed responses get it too."""
    any_origin = "*" in allowed_origins

    def allow(origin: str | None) -> str | None:
        if not origin:
            return None
        return "*" if any_origin else (origin if origin in allowed_origins else None)

    @web.middleware
    async def preflight(request: web.Request, handler):
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            if allow(request.headers.get("Origin")) is None:
                return APIError(403, "origin not allowed", code="cors_forbidden").response()
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get(
                    "Access-Control-Request-Headers", "Authorization, Content-Type"),
                "Access-Control-Max-Age": "600",
            })
        return await handler(request)

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        origin = allow(request.headers.get("Origin"))
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            if not any_origin:
                response.headers["Vary"] = "Origin"

    return preflight, on_prepare
