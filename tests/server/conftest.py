"""Server fixtures: the real model, loaded once per session, served on free loopback ports."""
from __future__ import annotations

import json

import pytest
from server_helpers import BLOCK_SIZE, BODY_LIMIT, MAX_MODEL_LEN, MODEL, http

from ember_cupy.config import EngineConfig
from ember_cupy.engine.llm_engine import LLMEngine
from ember_cupy.server import AsyncEngine, BackgroundServer, EngineMetrics, ServerSettings


@pytest.fixture(scope="session")
def start_server(checkpoint):
    """start_server(settings={...}, async_engine={AsyncEngine arguments}, engine_fields...) -> a
    running BackgroundServer on the shared checkpoint; every server started is stopped at the end
    of the session."""
    servers = []

    def start(settings: dict | None = None, engine_factory=None, async_engine: dict | None = None, **config):
        config = {"num_kv_blocks": 256, "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE, **config}
        cfg = EngineConfig(**config)
        llm_engine = (engine_factory or LLMEngine)(checkpoint, cfg)
        engine = AsyncEngine(llm_engine, metrics=EngineMetrics(MODEL), **(async_engine or {}))
        fields = {"host": "127.0.0.1", "port": 0, "served_model_names": [MODEL], "max_body_bytes": BODY_LIMIT,
                  **(settings or {})}
        server = BackgroundServer(engine, ServerSettings(**fields)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def server(start_server):
    return start_server()


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.url


@pytest.fixture(scope="session")
def client(base_url):
    import openai
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def spec(base_url) -> dict:
    """The default server's /openapi.json."""
    status, _, raw = http(base_url, "GET", "/openapi.json")
    assert status == 200
    return json.loads(raw)
