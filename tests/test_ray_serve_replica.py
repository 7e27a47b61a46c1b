"""An engine replica and the ingress's app, built in this process from the application's own
arguments (app.replica_kwargs / ingress_kwargs) on the real model, the Ray handle between them a
stand-in that calls the replica directly (tests/test_ray_serve.py drives a live cluster): what
the plain server honours, the replicas honour too: each prompt's index in its request, and
--prepare-timeout on the ingress (tokenizing, chat templates) and on the replicas (grammar compiles)."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("ray.serve", reason="needs the ray extra: pip install 'ember-cupy[ray]'")

MODEL = "smol"
SLOW_MARKER = "SLOW"      # a text (or a regex) whose preparation takes SLOW_SECONDS
SLOW_SECONDS = 1.5
PREPARE_TIMEOUT = 0.5


class _Call:
    """handle.<method>: .remote(...) as Ray's handle, on the in-process replica."""

    def __init__(self, method, streaming: bool):
        self.method, self.streaming = method, streaming

    def remote(self, *args, **kwargs):
        if self.streaming:
            return _Responses(self.method(*args, **kwargs))
        return self.method(*args, **kwargs)


class _Responses:
    """Ray's streaming response: __anext__ and cancel()."""

    def __init__(self, generator):
        self.generator = generator

    def __anext__(self):
        return self.generator.__anext__()

    def cancel(self):
        asyncio.ensure_future(self.generator.aclose())


class LocalHandle:
    """What RemoteEngine calls of the engine deployment's handle, on one replica in this process."""

    def __init__(self, replica, streaming: bool = False):
        self.replica, self.streaming = replica, streaming

    def options(self, stream: bool = False):
        return LocalHandle(self.replica, stream)

    @property
    def generate(self):
        return _Call(self.replica.generate, self.streaming)

    @property
    def info(self):
        async def info():
            return self.replica.info()
        return _Call(info, streaming=False)


def recording_engine(checkpoint, config):
    """The real engine, recording each request's prompt_index; its grammar compiles of a regex
    holding SLOW_MARKER take SLOW_SECONDS."""
    from ember_cupy.engine.llm_engine import LLMEngine
    from ember_cupy.structured import StructuredOutputsParams

    class RecordingEngine(LLMEngine):
        def add_request(self, *args, prompt_index: int = 0, **kwargs):
            self.prompt_indexes.append(prompt_index)
            return super().add_request(*args, prompt_index=prompt_index, **kwargs)

    engine = RecordingEngine(checkpoint, config)
    engine.prompt_indexes = []
    compile_fast = engine.grammars.compile

    def compile_slowly(params, abandoned=None):
        if SLOW_MARKER in str(params.regex):
            time.sleep(SLOW_SECONDS)
        return compile_fast(params, abandoned)
    engine.grammars.compile = compile_slowly
    compile_fast(StructuredOutputsParams(regex="[a-z]"))   # the first compile builds llguidance's tokenizer
    return engine


class SlowTokenizer:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def encode(self, text, *args, **kwargs):
        if SLOW_MARKER in text:
            time.sleep(SLOW_SECONDS)
        return self._tokenizer.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def app(checkpoint):
    """(base URL of the ingress's app, the replica's engine), on a loop in a thread of its own."""
    from ember_cupy.ray_serve import replica as replica_module
    from ember_cupy.ray_serve.app import RayServeArgs, ingress_kwargs, replica_kwargs
    from ember_cupy.ray_serve.ingress import OpenAIIngress
    from ember_cupy.ray_serve.replica import EngineReplica

    args = RayServeArgs(served_model_name=[MODEL], prepare_timeout=PREPARE_TIMEOUT,
                        engine_config={"num_kv_blocks": 64, "max_model_len": 256, "max_num_seqs": 1})
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def start():
        load = replica_module._load_engine
        replica_module._load_engine = lambda model, config: recording_engine(checkpoint, config)
        try:
            replica = EngineReplica.__new__(EngineReplica)
            await replica.__init__(**replica_kwargs(args))
        finally:
            replica_module._load_engine = load
        ingress = OpenAIIngress.__new__(OpenAIIngress)
        await ingress.__init__(LocalHandle(replica), **ingress_kwargs(args))
        ingress.engine.tokenizer = SlowTokenizer(ingress.engine.tokenizer)
        return replica, ingress

    replica, ingress = asyncio.run_coroutine_threadsafe(start(), loop).result(300)
    yield ingress.base_url, replica.engine.engine

    async def stop():
        await ingress.session.close()
        await ingress.server.stop(drain_timeout=0)
        await replica.engine.shutdown()
    asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=json.dumps({"model": MODEL, **body}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_each_prompt_reaches_the_replica_with_its_index_in_the_request(app):
    """The replica's scheduler serves every request's first prompt before any request's second
    (Sequence.prompt_index): a 3-prompt request's prompts must arrive as 0, 1, 2."""
    url, engine = app
    del engine.prompt_indexes[:]
    status, body = post(url, "/v1/completions", {"prompt": ["One", "Two", "Three"], "max_tokens": 1})
    assert status == 200 and len(body["choices"]) == 3, body
    assert sorted(engine.prompt_indexes) == [0, 1, 2]
    status, body = post(url, "/v1/embeddings", {"input": ["One", "Two"]})
    assert status == 200 and len(body["data"]) == 2, body
    assert sorted(engine.prompt_indexes[3:]) == [0, 1]


def test_the_ingress_times_out_slow_tokenizing_with_a_408(app):
    url, _ = app
    status, body = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": SLOW_MARKER}],
                                                      "max_tokens": 1})
    assert status == 408 and body["error"]["code"] == "timeout", body
    assert f"{PREPARE_TIMEOUT:g} s" in body["error"]["message"]
    status, body = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 1})
    assert status == 200, body


def test_a_replica_times_out_a_slow_grammar_compile_with_a_408(app):
    url, _ = app
    slow = {"prompt": "Digits:", "max_tokens": 2, "structured_outputs": {"regex": f"{SLOW_MARKER}[0-9]"}}
    status, body = post(url, "/v1/completions", slow)
    assert status == 408 and body["error"]["code"] == "timeout", body
    status, body = post(url, "/v1/completions", {**slow, "structured_outputs": {"regex": "[0-9]+"}})
    assert status == 200, body
