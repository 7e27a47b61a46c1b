"""Reading a JSON request body: content type, size, syntax, and typed fields with clear errors."""
from __future__ import annotations

import asyncio
import json
import math
import re

from aiohttp import web

from ember_cupy.server.errors import APIError, bad_request

_MISSING = object()
READ_TIMEOUT_KEY = web.AppKey("read_timeout", float)   # seconds a client may take to send a body
MAX_JSON_DEPTH = 64     # nesting levels of a request body; OpenAI's bodies need fewer than 10
# \uD800-\uDFFF escapes: the only way a lone surrogate gets into the decoded body (a raw UTF-8
# surrogate fails to decode); pairs are fine, so a match only means "walk the strings".
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json_body(request: web.Request) -> dict:
    """The body as a dict, or an APIError naming what is wrong with it."""
    if request.content_type != "application/json":
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


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Fields:
    """Typed access to the fields of a request body; each getter raises a 400 naming the field.

    `known` lists every field the endpoint understands (used or deliberately ignored);
    any other field is rejected, as OpenAI does.
    """

    def __init__(self, body: dict, known: set[str] | frozenset[str]):
        unknown = sorted(k for k in set(body) - set(known) if body[k] is not None)   # null = absent
        if unknown:
            raise bad_request(f"unrecognized request argument supplied: {unknown[0]}",
                              param=unknown[0], code="unknown_parameter")
        self.body = body

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def raw(self, name: str, default=None):
        value = self.body.get(name, _MISSING)
        return default if value is _MISSING or value is None else value

    def _wrong(self, name: str, expected: str, value) -> APIError:
        return bad_request(f"'{name}' must be {expected}, got {_json_type(value)}"
                           f"{'' if isinstance(value, (dict, list)) else ' ' + json.dumps(value)[:40]}",
                           param=name, code="invalid_type")

    def bool(self, name: str, default: bool | None = False):
        value = self.raw(name, _MISSING)
        if value is _MISSING:
            return default
        if not isinstance(value, bool):
            raise self._wrong(name, "a boolean", value)
        return value

    def int(self, name: str, default=None, lo: int | None = None, hi: int | None = None):
        value = self.raw(name, _MISSING)
        if value is _MISSING:
            return default
        if isinstance(value, float) and value.is_integer() and math.isfinite(value):
            value = int(value)
        if not is_int(value):
            raise self._wrong(name, "an integer", value)
        _check_range(name, value, lo, hi)
        return value

    def number(self, name: str, default=None, lo: float | None = None, hi: float | None = None):
        value = self.raw(name, _MISSING)
        if value is _MISSING:
            return default
        if not is_number(value):
            raise self._wrong(name, "a number", value)
        _check_range(name, value, lo, hi)
        return float(value)

    def str(self, name: str, default=None, non_empty: bool = False, choices=None):
        value = self.raw(name, _MISSING)
        if value is _MISSING:
            return default
        if not isinstance(value, str):
            raise self._wrong(name, "a string", value)
        if non_empty and not value:
            raise bad_request(f"'{name}' must not be empty", param=name)
        if choices is not None and value not in choices:
            raise bad_request(f"'{name}' must be one of {list(choices)}, got {value!r}", param=name)
        return value

    def dict(self, name: str):
        value = self.raw(name, _MISSING)
        if value is _MISSING:
            return None
        if not isinstance(value, dict):
            raise self._wrong(name, "an object", value)
        return value

    def str_list(self, name: str, max_items: int = 16, max_length: int | None = None) -> list[str]:
        """A string or a list of strings (stop sequences), each at most max_length characters."""
        value = self.raw(name, _MISSING)
        if value is _MISSING:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._wrong(name, "a string or an array of strings", value)
        if len(value) > max_items:
            raise bad_request(f"'{name}' may hold at most {max_items} items, got {len(value)}", param=name)
        if any(not v for v in value):
            raise bad_request(f"'{name}' must not contain empty strings", param=name)
        longest = max(map(len, value), default=0)
        if max_length is not None and longest > max_length:
            raise bad_request(f"'{name}' strings may be at most {max_length} characters long, got {longest}",
                              param=name)
        return value

    def int_list(self, name: str, lo: int | None = None) -> list[int]:
        value = self.raw(name, _MISSING)
        if value is _MISSING:
            return []
        if not isinstance(value, list) or not all(is_int(v) for v in value):
            raise self._wrong(name, "an array of integers", value)
        for v in value:
            _check_range(name, v, lo, None)
        return value


def _check_range(name: str, value, lo, hi) -> None:
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if lo is not None and hi is not None:
            bound = f"in [{lo}, {hi}]"
        elif lo is not None:
            bound = f">= {lo}"
        else:
            bound = f"<= {hi}"
        raise bad_request(f"'{name}' must be {bound}, got {value}", param=name)
