"""Anthropic's error shape, which the /v1/messages routes answer in (the SDKs and Claude Code read
it): {"type": "error", "error": {"type": ..., "message": ...}}, the HTTP status as OpenAI's."""
from __future__ import annotations

from ember_cupy.server.errors import APIError

MESSAGES_PREFIX = "/v1/messages"
# HTTP status -> Anthropic's error "type"
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def speaks_anthropic(path: str) -> bool:
    return path == MESSAGES_PREFIX or path.startswith(MESSAGES_PREFIX + "/")


def error_type(error: APIError) -> str:
    return ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")


def error_body(error: APIError) -> dict:
    return {"type": "error", "error": {"type": error_type(error), "message": error.message}}
