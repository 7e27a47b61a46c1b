"""Raw HTTP and /metrics helpers for the server tests."""
from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request

MODEL = "smol"            # the served model name in the tests
MAX_MODEL_LEN = 512
BLOCK_SIZE = 16
BODY_LIMIT = 256 * 1024


def http(base_url: str, method: str, path: str, body=None, headers: dict | None = None,
         timeout: float = 60) -> tuple[int, dict, bytes]:
    """One raw HTTP request: (status, headers, body bytes). body: bytes, or JSON-encodable."""
    headers = dict(headers or {})
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    request = urllib.request.Request(base_url + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def documented(spec: dict, model: str, body: dict) -> None:
    """body holds to the component schema `model` of an /openapi.json (jsonschema's error if not)."""
    import jsonschema
    schema = {"$ref": f"#/components/schemas/{model}", "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(body)


def metric(base_url: str, name: str, **labels) -> float | None:
    """The value of one sample on /metrics (summed over label sets matching `labels`)."""
    _, _, text = http(base_url, "GET", "/metrics")
    return _sample(text.decode(), name, labels)


def metrics(base_url: str, *names: str) -> list[float | None]:
    """Several samples from one read of /metrics: gauges compared with each other must not move
    between two reads."""
    _, _, text = http(base_url, "GET", "/metrics")
    return [_sample(text.decode(), name, {}) for name in names]


def _sample(text: str, name: str, labels: dict) -> float | None:
    total, found = 0.0, False
    for line in text.splitlines():
        match = re.match(r"^([\w:]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
            found = True
    return total if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parallel(*calls):
    """Run the zero-argument callables concurrently (their requests share engine steps)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def leaving_mid_stream_aborts(base_url: str, path: str, body: dict, line_start: bytes = b"") -> None:
    """A client that reads two lines of a streamed reply (those starting with line_start) and
    leaves: its request is aborted (counted once) and every KV block is free again."""
    import asyncio

    import aiohttp
    from test_cancellation import _wait_idle
    _wait_idle(base_url)
    aborted_before = metric(base_url, "ember:request_success_total", finished_reason="abort") or 0.0

    async def leave_after_two_lines():
        async with aiohttp.ClientSession() as session:
            response = await session.post(base_url + path, json=body)
            lines = 0
            async for line in response.content:
                lines += line.startswith(line_start) and bool(line.strip())
                if lines == 2:
                    break
            response.close()
            return lines

    assert asyncio.run(asyncio.wait_for(leave_after_two_lines(), 60)) == 2
    _wait_idle(base_url)
    assert metric(base_url, "ember:kv_cache_free_blocks") == metric(base_url, "ember:kv_cache_total_blocks")
    assert metric(base_url, "ember:request_success_total", finished_reason="abort") - aborted_before == 1
