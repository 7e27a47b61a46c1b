"""Many models in one server (ModelPool + the router app) on the real model: a directory of two
GGUF files (links to the default model) and a file that is not a model; /v1/models lists both
with their status, a first request gets 503 + Retry-After while its model loads, then answers;
models_max 1 unloads the least recently used; /models/load and /models/unload; an idle TTL; a
memory budget refusing what cannot fit."""
from __future__ import annotations

import os
import time

import openai
import pytest
from server_helpers import BLOCK_SIZE, MAX_MODEL_LEN, http

from ember_cupy.config import EngineConfig
from ember_cupy.engine.llm_engine import LLMEngine
from ember_cupy.model.loader import describe_model, resolve_model_path
from ember_cupy.server import AsyncEngine, BackgroundServer, EngineMetrics, ServerSettings
from ember_cupy.server.api import build_app
from ember_cupy.server.model_pool import ModelPool, discover_models
from ember_cupy.server.model_router import build_router_app


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    default = resolve_model_path(None)
    for name in ("smol-a", "smol-b"):
        os.symlink(default, root / f"{name}.gguf")
    (root / "notes.txt").write_text("not a model")
    (root / "no-config").mkdir()
    return root


def _router(models_dir, checkpoint, api_key=None, **pool_args) -> BackgroundServer:
    settings = ServerSettings(host="127.0.0.1", port=0, api_key=api_key)
    loads = []

    def make_app(name, path):
        loads.append(name)
        config = EngineConfig(num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
        engine = AsyncEngine(factory=lambda: LLMEngine(path, config), metrics=EngineMetrics(name))
        return engine, build_app(engine, ServerSettings(served_model_names=[name]))

    pool = ModelPool(discover_models(str(models_dir)), make_app, describe=describe_model, **pool_args)
    server = BackgroundServer(None, settings, app=build_router_app(pool, settings)).start()
    server.loads = loads
    return server


def _chat(url, model, **kwargs):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, **kwargs)


def _until_loaded(url, model, timeout=120):
    """The first request: 503 + Retry-After while the model loads, then the answer."""
    statuses, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, headers, _ = http(url, "POST", "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        statuses.append(status)
        if status != 503:
            return statuses
        assert headers.get("Retry-After"), headers
        time.sleep(0.2)
    raise AssertionError(f"{model} did not load in {timeout} s: {statuses[-5:]}")


def _status(url, model):
    _, _, body = http(url, "GET", "/v1/models")
    import json
    return {m["id"]: m["status"]["value"] for m in json.loads(body)["data"]}[model]


def test_models_load_on_demand_and_the_least_recently_used_unloads(models_dir, checkpoint):
    server = _router(models_dir, checkpoint, models_max=1)
    try:
        url = server.url
        import json
        _, _, body = http(url, "GET", "/v1/models")
        assert sorted(m["id"] for m in json.loads(body)["data"]) == ["smol-a", "smol-b"]
        assert _status(url, "smol-a") == "unloaded"
        statuses = _until_loaded(url, "smol-a")
        assert statuses[0] == 503 and statuses[-1] == 200
        assert _chat(url, "smol-a").model == "smol-a" and _status(url, "smol-a") == "loaded"
        _until_loaded(url, "smol-b")          # models_max 1: smol-a makes room
        assert _status(url, "smol-a") == "unloaded" and _status(url, "smol-b") == "loaded"
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            _chat(url, "smol-c")
        status, _, body = http(url, "POST", "/models/unload", {"model": "smol-b"})
        assert status == 200 and _status(url, "smol-b") == "unloaded"
        status, _, body = http(url, "POST", "/models/load", {"model": "smol-a"})
        assert status == 200 and json.loads(body)["status"] == "loaded"
        assert _chat(url, "smol-a").choices[0].message.content
        assert server.loads == ["smol-a", "smol-b", "smol-a"]
        _, _, metrics = http(url, "GET", "/metrics")
        assert metrics.count(b"# TYPE vllm:num_requests_running") == 1 and b'model_name="smol-a"' in metrics
    finally:
        server.stop()


def test_an_idle_model_unloads_after_its_ttl(models_dir, checkpoint):
    server = _router(models_dir, checkpoint, idle_ttl=0.5)
    try:
        http(server.url, "POST", "/models/load", {"model": "smol-a"})
        assert _status(server.url, "smol-a") == "loaded"
        deadline = time.monotonic() + 10
        while _status(server.url, "smol-a") == "loaded" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _status(server.url, "smol-a") == "unloaded"
    finally:
        server.stop()


def test_a_model_larger_than_the_memory_budget_is_refused(models_dir, checkpoint):
    size = os.path.getsize(resolve_model_path(None))
    server = _router(models_dir, checkpoint, memory_budget=size // 2)
    try:
        status, _, body = http(server.url, "POST", "/models/load", {"model": "smol-a"})
        assert status == 400 and b"memory budget" in body
        status, _, body = http(server.url, "POST", "/v1/chat/completions", {
            "model": "smol-b", "messages": [{"role": "user", "content": "Hi"}]})
        assert status == 400 and b"model_too_large" in body
    finally:
        server.stop()
    server = _router(models_dir, checkpoint, memory_budget=int(size * 1.5))   # room for one of the two
    try:
        assert http(server.url, "POST", "/models/load", {"model": "smol-a"})[0] == 200
        assert http(server.url, "POST", "/models/load", {"model": "smol-b"})[0] == 200
        assert _status(server.url, "smol-a") == "unloaded"
    finally:
        server.stop()


def test_discovery_takes_gguf_files_and_model_folders(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "big-00001-of-00002.gguf").write_bytes(b"")
    (tmp_path / "big-00002-of-00002.gguf").write_bytes(b"")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "other").mkdir()
    assert sorted(discover_models(str(tmp_path))) == ["a", "big", "hf"]
    with pytest.raises(ValueError, match="not a directory"):
        discover_models(str(tmp_path / "a.gguf"))


def test_ollamas_routes_list_the_directory_and_reach_each_model(models_dir, checkpoint):
    import json
    server = _router(models_dir, checkpoint, models_max=1)
    try:
        url = server.url
        _, _, body = http(url, "GET", "/api/tags")
        tags = json.loads(body)["models"]     # described from the files' headers, none loaded
        assert [t["name"] for t in tags] == ["smol-a:latest", "smol-b:latest"] and not server.loads
        assert {(t["details"]["family"], t["details"]["quantization_level"]) for t in tags} == {("llama", "Q4_1")}
        assert json.loads(http(url, "GET", "/api/ps")[2]) == {"models": []}
        chat = {"model": "smol-b:latest", "messages": [{"role": "user", "content": "Hi"}], "stream": False,
                "options": {"num_predict": 2}}
        deadline = time.monotonic() + 120
        status, _, body = http(url, "POST", "/api/chat", chat)
        while status == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
            status, _, body = http(url, "POST", "/api/chat", chat)
        assert status == 200 and json.loads(body)["done"] and server.loads == ["smol-b"]
        (running,) = json.loads(http(url, "GET", "/api/ps")[2])["models"]
        assert running["name"] == "smol-b:latest" and running["context_length"] == MAX_MODEL_LEN
        status, _, body = http(url, "POST", "/api/chat", dict(chat, model="smol-c"))
        assert status == 404 and "smol-c" in json.loads(body)["error"]
        assert json.loads(http(url, "GET", "/api/version")[2])["version"]
        # `ollama stop smol-b`: keep_alive 0 and nothing asked unloads it
        status, _, body = http(url, "POST", "/api/generate", {"model": "smol-b:latest", "keep_alive": 0, "bogus": 1})
        assert status == 400 and json.loads(http(url, "GET", "/api/ps")[2])["models"]
        status, _, body = http(url, "POST", "/api/generate", {"model": "smol-b:latest", "keep_alive": 0})
        assert status == 200 and (json.loads(body)["done_reason"], json.loads(body)["model"]) == ("unload",
                                                                                                   "smol-b:latest")
        assert json.loads(http(url, "GET", "/api/ps")[2]) == {"models": []}
    finally:
        server.stop()


def test_llama_servers_routes_reach_the_model_they_name(models_dir, checkpoint):
    import json
    server = _router(models_dir, checkpoint, models_max=1)
    try:
        url, body = server.url, {"model": "smol-a", "prompt": "Hi", "n_predict": 2, "temperature": 0}
        deadline = time.monotonic() + 120
        status, _, raw = http(url, "POST", "/completion", body)
        while status == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
            status, _, raw = http(url, "POST", "/completion", body)
        assert status == 200 and json.loads(raw)["model"] == "smol-a" and server.loads == ["smol-a"]
        props = json.loads(http(url, "GET", "/props?model=smol-a")[2])
        assert props["model_alias"] == "smol-a" and props["default_generation_settings"]["n_ctx"] == MAX_MODEL_LEN
        template = {"model": "smol-a", "messages": [{"role": "user", "content": "Hi"}]}
        assert json.loads(http(url, "POST", "/apply-template", template)[2])["prompt"].endswith("assistant\n")
        status, _, raw = http(url, "POST", "/completion", dict(body, model="smol-c"))
        assert status == 404 and "smol-c" in json.loads(raw)["error"]["message"]
    finally:
        server.stop()


def test_an_api_key_guards_loading_and_unloading(models_dir, checkpoint):
    """With --api-key nobody without it may load or unload a model (a memory or denial-of-service
    lever); /health stays public."""
    server = _router(models_dir, checkpoint, api_key="sekret")
    try:
        for path in ("/models/load", "/models/unload", "/v1/models", "/props?model=smol-a"):
            method, body = ("GET", None) if path.startswith(("/v1/", "/props")) else ("POST", {"model": "smol-a"})
            assert http(server.url, method, path, body)[0] == 401, path
        assert not server.loads and http(server.url, "GET", "/health")[0] == 200
        status, _, _ = http(server.url, "POST", "/models/load", {"model": "smol-a"},
                            headers={"Authorization": "Bearer sekret"})
        assert status == 200 and server.loads == ["smol-a"]
    finally:
        server.stop()
