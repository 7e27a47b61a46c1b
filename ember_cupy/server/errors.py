"""OpenAI-shaped errors: every failure leaves the server as {"error": {message, type, param, code}}."""
from __future__ import annotations

import json
import re

from aiohttp import web
from pydantic import ValidationError

from ember_cupy.error_text import MAX_MESSAGE_CHARS, one_line  # noqa: F401 (MAX_MESSAGE_CHARS: re-exported)

# HTTP status -> OpenAI's error "type".
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error with an HTTP status, rendered in OpenAI's shape; its message one bounded line."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None, headers: dict | None = None,
                 close: bool = False):
        message = one_line(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}
        self.close = close   # close the connection after the response (the request was not read whole)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, body: dict | None = None) -> web.Response:
        """The error as an HTTP response; `body` instead of OpenAI's (another API's shape)."""
        response = web.Response(status=self.status, text=json.dumps(self.body() if body is None else body),
                                content_type="application/json", headers=self.headers)
        if self.close:
            response.force_close()
        return response


CONSTRAINT_FAILED = "the output constraint failed during generation (a limit of the grammar engine)"


def constraint_failed() -> APIError:
    """A request whose output constraint failed mid-way (finish_reason "error")."""
    return APIError(500, CONSTRAINT_FAILED, code="constraint_failed")


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


_PARAM_IN_MESSAGE = re.compile(r"^SamplingParams\.(\w+)")


def from_value_error(exc: ValueError, param: str | None = None) -> APIError:
    """An engine/SamplingParams ValueError as a 400; the field it names becomes `param`."""
    message = str(exc) or "invalid request"
    match = _PARAM_IN_MESSAGE.match(message)
    if match:
        param = param or match.group(1)
        message = message[len("SamplingParams."):]
    if param is None and message.startswith("n="):
        param = "n"
    if param is None and "prompt" in message:
        param = "prompt"
    code = "context_length_exceeded" if "context" in message else "invalid_value"
    return APIError(400, message, param=param, code=code)


def from_http_exception(exc: web.HTTPException) -> APIError:
    """aiohttp's own errors (404 route, 405 method, 413 body size) in OpenAI's shape."""
    status = exc.status
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    message = exc.text or exc.reason
    if status == 404:
        message = "no such route"
    elif status == 405:
        message = f"method not allowed; allowed: {', '.join(sorted(exc.allowed_methods))}" \
            if isinstance(exc, web.HTTPMethodNotAllowed) else (exc.reason or "method not allowed")
    elif status == 413:
        message = "request body is too large" + (f" ({exc.text})" if exc.text else "")
    headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
    return APIError(status, message, code=codes.get(status), headers=headers)


# pydantic error type -> OpenAI error code (every other type: "invalid_value")
_CODES = {"extra_forbidden": "unknown_parameter", "missing": "missing_required_parameter",
          "none_required": "unsupported_parameter"}
_OBJECT_TYPES = {"model_type", "model_attributes_type", "dict_type"}   # pydantic names Python types there


def field_path(loc: tuple) -> str | None:
    """A pydantic error location as OpenAI writes a field: messages[0].content, logit_bias.42."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "[key]":      # pydantic's marker of a bad dict key: the key itself is the place
            path += f".{part}" if path else part
    return path or None


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem a request model found, as a 400 whose `param` is the field's path."""
    error = exc.errors(include_url=False)[0]
    kind, param = error["type"], field_path(error["loc"])
    code = _CODES.get(kind, "invalid_type" if kind.endswith("_type") else "invalid_value")
    if kind == "extra_forbidden":
        message = f"unrecognized request argument supplied: {param}"
    elif kind == "missing":
        message = f"'{param}' is required"
    elif kind == "none_required":
        message = f"'{param}' is not supported"
    else:
        detail = "must be a JSON object" if kind in _OBJECT_TYPES else error["msg"].removeprefix("Value error, ")
        value = error.get("input")
        if isinstance(value, (bool, int, float, str)) and kind != "value_error":
            detail += f", got {json.dumps(value)[:40]}"
        message = f"'{param}': {detail}" if param else detail
    return APIError(400, message, param=param, code=code)
