"""The ingress, built without a Ray cluster: a stand-in engine handle answers `info`, the ingress
builds the server's app over it and is called as Serve calls it (tests/test_ray_serve.py drives a
live cluster; tests/test_ray_serve_replica.py serves requests through it on the real model)."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
from types import SimpleNamespace

import aiohttp
import pytest

pytest.importorskip("ray.serve", reason="needs the ray extra: pip install 'ember-cupy[ray]'")

from starlette.requests import Request  # noqa: E402
from tiny_model import write_tiny_checkpoint  # noqa: E402

from ember_cupy.engine_client import ModelInfo  # noqa: E402


class _Method:
    def __init__(self, answer):
        self.answer = answer

    async def remote(self):
        return self.answer


def _engine_handle() -> SimpleNamespace:
    """What RemoteEngine.start reads of an engine replica's `info`."""
    info = {"model_info": ModelInfo(max_model_len=64, vocab_size=49152, hidden_size=576, policy="fcfs",
                                    max_num_seqs=4, block_size=16, quantization="none", weight_bytes=0,
                                    kv_cache_blocks=8, runtime={}, sampling_defaults={})}
    return SimpleNamespace(info=_Method(info))


async def _call_as_serve_does(ingress, method: str, path: str, client: tuple[str, int]) -> tuple[int, dict, bytes]:
    """One request, as Serve's replica hands it over: a starlette Request, then the ASGI response."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"host", b"example.test")], "client": client, "server": ("10.0.0.1", 8000)}
    pending = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if pending:
            return pending.pop()
        await asyncio.Event().wait()   # the client stays

    sent = []

    async def send(message):
        sent.append(message)
    response = await ingress(Request(scope, receive, send))
    await response(scope, receive, send)
    start = sent[0]
    return (start["status"], {k.decode(): v.decode() for k, v in start["headers"]},
            b"".join(m.get("body", b"") for m in sent[1:]))


def _serve_one(model_dir: str, method: str, path: str, client: tuple[str, int]) -> tuple[int, dict, bytes]:
    from ember_cupy.ray_serve.ingress import OpenAIIngress

    async def build_and_ask():
        ingress = OpenAIIngress.__new__(OpenAIIngress)
        await ingress.__init__(_engine_handle(), model=model_dir, server_settings={"served_model_names": ["tiny"]})
        try:
            return await _call_as_serve_does(ingress, method, path, client)
        finally:
            await ingress.stop()
    return asyncio.run(build_and_ask())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(path)
    return str(path)


def test_the_ingress_serves_in_process_without_a_socket_or_an_http_client(model_dir, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise AssertionError("the ingress opened a listening socket or an HTTP client")
    monkeypatch.setattr(asyncio.BaseEventLoop, "create_server", refuse)
    monkeypatch.setattr(socket.socket, "listen", refuse)
    monkeypatch.setattr(aiohttp.ClientSession, "__init__", refuse)
    caplog.set_level(logging.INFO, logger="ember_cupy.server.access")
    status, headers, body = _serve_one(model_dir, "GET", "/v1/models", client=("10.0.0.7", 5123))
    assert status == 200 and headers["content-type"].startswith("application/json")
    assert [card["id"] for card in json.loads(body)["data"]] == ["tiny"]
    # the app sees Serve's client, not a loopback peer
    assert any(r.getMessage().startswith("10.0.0.7 GET /v1/models 200") for r in caplog.records)


def test_serves_max_ongoing_requests_is_the_ingress_only_limit():
    from ember_cupy.ray_serve.app import RayServeArgs, build, ingress_kwargs
    from ember_cupy.ray_serve.ingress import MAX_ONGOING_REQUESTS
    assert RayServeArgs().ingress_max_ongoing_requests == MAX_ONGOING_REQUESTS == 1024
    args = RayServeArgs(ingress_max_ongoing_requests=300)
    assert build(args)._bound_deployment.max_ongoing_requests == 300   # no public accessor on Application
    assert "max_ongoing_requests" not in ingress_kwargs(args)   # no connection pool to size
