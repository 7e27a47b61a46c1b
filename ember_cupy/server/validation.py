"""Reading a JSON request body: content type, size, time, syntax, depth and valid Unicode.
What the fields must be is the protocol models' business (server/protocol/)."""
from __future__ import annotations

import asyncio
import json
import re

from aiohttp import web

from ember_cupy.server.errors import APIError, bad_request

READ_TIMEOUT_KEY = web.AppKey("read_timeout", float)   # seconds a client may take to send a body
MAX_JSON_DEPTH = 64     # nesting levels of a request body; OpenAI's bodies need fewer than 10
# \uD800-\uDFFF escapes: the only way a lone surrogate gets into the decoded body (a raw UTF-8
# surrogate fails to decode); pairs are fine, so a match only means "walk the strings".
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json_body(request: web.Request, any_content_type: bool = False) -> dict:
    """The body as a dict, or an APIError naming what is wrong with it. any_content_type: read it as
    JSON whatever its Content-Type says (Ollama's routes: its docs' curl examples send none), unless
    a browser sent it (an Origin header): a page must send application/json, which a CORS preflight
    guards, so no site can drive the server through a user's browser with a plain form post."""
    lenient = any_content_type and "Origin" not in request.headers
    if request.content_type != "application/json" and not lenient:
        got = request.headers.get("Content-Type") or "none"
        raise APIError(415, f"Content-Type must be application/json, got {got!r}",
                       code="unsupported_media_type")
    timeout = request.app.get(READ_TIMEOUT_KEY) if request.app is not None else None
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:   # TimeoutError itself from Python 3.11 on
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout", close=True) from None
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"request body is too large: at most {request.client_max_size} bytes",
                       code="request_too_large") from None
    if not raw.strip():
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise bad_request("request body is not valid UTF-8", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise too_deep() from None
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH or _SURROGATE_ESCAPE.search(raw):
        check_structure(body)
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {_json_type(body)}",
                          code="invalid_json")
    return body


def too_deep() -> APIError:
    return bad_request(f"request body is nested too deeply: at most {MAX_JSON_DEPTH} levels",
                       code="invalid_json")


def check_structure(body) -> None:
    """400 if the decoded body nests deeper than MAX_JSON_DEPTH or holds a string with a lone
    UTF-16 surrogate (no tokenizer, and no UTF-8 encoder, accepts one). Iterative: a body that
    json could decode cannot overflow the stack here. `param` is the top-level field it is in."""
    stack = [(body, 1, None)]
    while stack:
        value, depth, field = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise too_deep()
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, field)
                top = key if field is None else field
                kind = type(item)
                if kind is str:
                    _check_text(item, top)
                elif kind is dict or kind is list:
                    stack.append((item, depth + 1, top))
        else:  # a list
            for item in value:
                kind = type(item)
                if kind is str:
                    _check_text(item, field)
                elif kind is dict or kind is list:
                    stack.append((item, depth + 1, field))


def _check_text(text: str, field: str | None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"'{field}'" if field is not None else "a field name"
        raise bad_request(f"{where} contains a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x}) at "
                          f"character {exc.start}: text must be valid Unicode",
                          param=field, code="invalid_value") from None


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
