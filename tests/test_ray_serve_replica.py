"""An engine replica and the ingress, built in this process from the application's own
arguments (app.replica_kwargs / ingress_kwargs) on the real model, the Ray handle between them a
stand-in that calls the replica directly, Serve's HTTP proxy in front a stand-in too
(serve_proxy.py; tests/test_ray_serve.py drives a live cluster): what
the plain server honours, the replicas honour too: each prompt's index in its request, and
--prepare-timeout on the ingress (tokenizing, chat templates) and on the replicas (grammar compiles)."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("ray.serve", reason="needs the ray extra: pip install 'ember-cupy[ray]'")

pytest.importorskip("uvicorn", reason="Serve's proxy stand-in runs on uvicorn (a ray[serve] dependency)")

from serve_proxy import ProxyServer  # noqa: E402

from ember_cupy.server.api import ServerSettings  # noqa: E402
from ember_cupy.server.launcher import Server  # noqa: E402

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
    """The model's tokenizer, slow on SLOW_MARKER, recording each text it encodes."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.encoded: list[str] = []

    def encode(self, text, *args, **kwargs):
        self.encoded.append(text)
        if SLOW_MARKER in text:
            time.sleep(SLOW_SECONDS)
        return self._tokenizer.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def served(checkpoint):
    """url (Serve's proxy stand-in before the ingress), replica, ingress, plain_url (`ember-cupy
    serve`'s app on the replica's engine, to compare with) and loop (all of them run on it)."""
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
        replica.engine.engine.tokenizer = SlowTokenizer(replica.engine.engine.tokenizer)
        proxy = ProxyServer(ingress)
        plain = Server(replica.engine, ServerSettings(**ingress_kwargs(args)["server_settings"], port=0))
        await plain.start()
        return SimpleNamespace(url=await proxy.start(), replica=replica, ingress=ingress, proxy=proxy,
                               plain=plain, plain_url=f"http://127.0.0.1:{plain.port}", loop=loop)

    served = asyncio.run_coroutine_threadsafe(start(), loop).result(300)
    yield served

    async def stop():
        await served.proxy.stop()
        await served.ingress.stop()
        await served.plain.stop(drain_timeout=0)   # and the replica's engine
    asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)


@pytest.fixture(scope="module")
def app(served):
    """(base URL of the ingress, the replica's engine)."""
    return served.url, served.replica.engine.engine


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


def test_a_prompt_is_tokenized_once_on_the_ingress_and_never_on_the_replica(served):
    prompt = "Tokenize me exactly once, please:"
    ingress_seen, replica_seen = served.ingress.engine.tokenizer.encoded, served.replica.engine.engine.tokenizer.encoded
    status, body = post(served.url, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert status == 200, body
    assert ingress_seen.count(prompt) == 1
    assert prompt not in replica_seen


def _stream(url: str, max_tokens: int):
    body = {"model": MODEL, "prompt": "Tell me a long story about a dragon.", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    return httpx.stream("POST", url + "/v1/completions", json=body, timeout=120)


def test_sse_arrives_while_the_replica_is_still_generating(served):
    engine = served.replica.engine.engine
    with _stream(served.url, max_tokens=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        assert engine.num_running + engine.num_waiting == 1   # a buffered answer would come after the end
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and len(rest) >= 100


def test_a_client_that_leaves_aborts_its_request_on_the_replica(served):
    replica, engine = served.replica, served.replica.engine.engine
    cancelled = replica.requests_cancelled
    with _stream(served.url, max_tokens=200) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert engine.num_running + engine.num_waiting == 1
    deadline = time.monotonic() + 30
    while not (replica.requests_cancelled == cancelled + 1 and engine.num_running + engine.num_waiting == 0
               and replica.engine.num_in_flight == 0
               and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks):
        assert time.monotonic() < deadline, (replica.requests_cancelled, engine.num_running,
                                             engine.block_manager.num_free_blocks)
        time.sleep(0.1)


JSON = {"Content-Type": "application/json"}
BAD_REQUESTS = [   # (method, path, body, headers)
    ("POST", "/v1/completions", b'{"prompt": "x",', JSON),
    ("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode(), {"Content-Type": "text/plain"}),
    ("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1}).encode(), JSON),
    ("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "word " * 300}).encode(), JSON),
    ("POST", "/v1/completions", b'{"prompt": "' + b"x" * (4 << 20) + b'"}', JSON),
    ("POST", "/v1/chat/completions", json.dumps({"model": "gpt-9", "messages": []}).encode(), JSON),
    ("POST", "/v1/messages", json.dumps({"model": MODEL, "max_tokens": 1}).encode(), JSON),
    ("PUT", "/v1/chat/completions", b"{}", JSON),
    ("GET", "/v1/nothing?x=1", b"", {}),
]
# set by each server (and Serve's proxy) for its own connection, or for the moment
_PER_CONNECTION = {"date", "server", "content-length", "connection", "keep-alive", "transfer-encoding"}


def _answer(url: str, method: str, path: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    response = httpx.request(method, url + path, content=body, headers=headers, timeout=60)
    kept = {k: v for k, v in response.headers.items() if k not in _PER_CONNECTION}
    return response.status_code, kept, response.content


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=lambda case: f"{case[0]} {case[1]} {len(case[2])}B")
def test_bad_requests_get_the_plain_servers_status_headers_and_body(served, case):
    ours, plain = _answer(served.url, *case), _answer(served.plain_url, *case)
    assert 400 <= ours[0] < 500 and ours == plain
