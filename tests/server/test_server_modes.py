"""Overload (503 + Retry-After), API key, CORS, loading and dead engines."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import pytest
from server_helpers import MODEL, http

from ember_cupy.config import EngineConfig
from ember_cupy.engine.llm_engine import LLMEngine
from ember_cupy.server import AsyncEngine, BackgroundServer, EngineMetrics, ServerSettings

KEY = "sekret-key"


def _error(raw: bytes) -> dict:
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_overload_503_with_retry_after(start_server):
    server = start_server(max_num_seqs=1, max_waiting=2, num_kv_blocks=64)
    url = server.url + "/v1/completions"

    async def one(session, i):
        body = {"model": MODEL, "prompt": f"Item {i}", "max_tokens": 3, "temperature": 0}
        async with session.post(url, json=body) as response:
            return response.status, response.headers.get("Retry-After"), await response.read()

    async def run():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*[one(session, i) for i in range(8)])

    results = asyncio.run(run())
    statuses = [status for status, _, _ in results]
    assert 503 in statuses and 200 in statuses, statuses
    for status, retry_after, raw in results:
        if status == 503:
            assert retry_after is not None and int(retry_after) >= 1
            assert _error(raw)["code"] == "server_overloaded"
        else:
            assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] <= 3
    status, _, _ = http(server.url, "POST", "/v1/completions", {"prompt": "again", "max_tokens": 1})
    assert status == 200   # the queue drained


@pytest.fixture(scope="module")
def secured(start_server):
    return start_server(settings={"api_key": KEY, "allowed_origins": ["http://ok.example"]}, num_kv_blocks=32)


def test_api_key_required(secured):
    url = secured.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, _, raw = http(url, "GET", "/v1/models", headers=headers)
        assert status == 401 and _error(raw)["code"] == "invalid_api_key"
    status, _, raw = http(url, "POST", "/v1/completions", {"prompt": "x"})
    assert status == 401 and _error(raw)["type"] == "authentication_error"
    assert http(url, "POST", "/tokenize", {"prompt": "x"})[0] == 401
    assert http(url, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    assert http(url, "GET", "/health")[0] == 200     # probes need no key
    assert http(url, "GET", "/metrics")[0] == 200
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def test_cors_when_enabled(secured):
    auth = {"Authorization": f"Bearer {KEY}"}
    _, headers, _ = http(secured.url, "GET", "/v1/models", headers={**auth, "Origin": "http://ok.example"})
    assert headers.get("Access-Control-Allow-Origin") == "http://ok.example"
    _, headers, _ = http(secured.url, "GET", "/v1/models", headers={**auth, "Origin": "http://evil.example"})
    assert "Access-Control-Allow-Origin" not in headers
    status, headers, _ = http(secured.url, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://ok.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 204 and "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Origin"] == "http://ok.example"
    status, _, raw = http(secured.url, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert status == 403 and _error(raw)


def test_cors_off_by_default(base_url):
    _, headers, _ = http(base_url, "GET", "/v1/models", headers={"Origin": "http://ok.example"})
    assert not any(h.lower().startswith("access-control-") for h in headers)
    status, headers, raw = http(base_url, "OPTIONS", "/v1/completions", headers={
        "Origin": "http://ok.example", "Access-Control-Request-Method": "POST"})
    assert status == 405 and _error(raw) and "Access-Control-Allow-Origin" not in headers


def test_binds_loopback_by_default():
    assert ServerSettings().host == "127.0.0.1"


class _ExplodingEngine(LLMEngine):
    """Makes no progress until two requests are in, then fails."""

    def step(self):
        time.sleep(0.02)
        if len(self.requests) >= 2:
            raise RuntimeError("boom")
        return []


def test_dead_engine_fails_pending_requests_and_health(start_server):
    server = start_server(engine_factory=_ExplodingEngine, num_kv_blocks=16)
    url = server.url

    async def run():
        async with aiohttp.ClientSession() as session:
            async def full():
                async with session.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 4}) as r:
                    return r.status, await r.read()

            async def streamed():
                async with session.post(url + "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "b"}], "max_tokens": 4, "stream": True}) as r:
                    return r.status, await r.read()
            return await asyncio.gather(full(), streamed())

    (status, raw), (stream_status, stream_raw) = asyncio.run(asyncio.wait_for(run(), 30))
    assert status == 503 and _error(raw)["code"] == "engine_dead" and "boom" in _error(raw)["message"]
    assert stream_status == 200
    events = [line[6:] for line in stream_raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "engine_dead" in events[-2]
    status, _, raw = http(url, "GET", "/health")
    assert status == 503 and json.loads(raw)["status"] == "dead" and "boom" in _error(raw)["message"]
    status, _, raw = http(url, "POST", "/v1/completions", {"prompt": "c"})
    assert status == 503 and _error(raw)["code"] == "engine_dead"


def test_health_503_while_loading(checkpoint):
    release = threading.Event()

    def factory():
        release.wait(30)
        return LLMEngine(checkpoint, EngineConfig(num_kv_blocks=16))

    engine = AsyncEngine(factory=factory, metrics=EngineMetrics(MODEL))
    server = BackgroundServer(engine, ServerSettings(port=0, served_model_names=[MODEL])).start(wait_ready=False)
    try:
        status, _, raw = http(server.url, "GET", "/health")
        assert status == 503 and json.loads(raw)["status"] == "loading"
        status, headers, raw = http(server.url, "POST", "/v1/completions", {"prompt": "x"})
        assert status == 503 and _error(raw)["code"] == "engine_not_ready" and "Retry-After" in headers
        release.set()
        deadline = time.monotonic() + 30
        while http(server.url, "GET", "/health")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http(server.url, "GET", "/health")[0] == 200
    finally:
        release.set()
        server.stop()


def test_failed_load_reports_dead():
    def factory():
        raise FileNotFoundError("no such model: /nowhere.gguf")

    engine = AsyncEngine(factory=factory)
    server = BackgroundServer(engine, ServerSettings(port=0)).start(wait_ready=False)
    try:
        deadline = time.monotonic() + 10
        while engine.state.value != "dead" and time.monotonic() < deadline:
            time.sleep(0.02)
        status, _, raw = http(server.url, "GET", "/health")
        assert status == 503 and "nowhere.gguf" in _error(raw)["message"]
    finally:
        server.stop()


@pytest.mark.parametrize("error, traceback", [(ValueError("model.gguf: the file ends inside its GGUF header"), False),
                                              (FileNotFoundError("no such model: /nowhere.gguf"), False),
                                              (RuntimeError("a bug in the loader"), True)])
def test_failed_load_logs_the_files_fault_without_a_traceback(error, traceback, caplog):
    """A bad file's ValueError / OSError already says what is wrong: its log line stands alone. Any
    other exception is a bug, logged with its traceback."""
    def factory():
        raise error

    engine = AsyncEngine(factory=factory)
    with caplog.at_level("ERROR", logger="ember_cupy.server"), pytest.raises(type(error)):
        asyncio.run(engine.start())
    [record] = [r for r in caplog.records if "loading the model failed" in r.getMessage()]
    assert str(error) in record.getMessage() and (record.exc_info is not None) == traceback
