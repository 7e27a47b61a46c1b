"""Issue 11 over HTTP against the real server: admission, timeouts, parser errors, auth, metrics."""
from __future__ import annotations

import asyncio
import json

import aiohttp
from server_helpers import MODEL


def _error(raw: bytes) -> dict:
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_max_waiting_counts_only_requests_that_really_wait(start_server):
    """A burst that fits in the free sequence slots is admitted at once: none of it waits."""
    server = start_server(max_waiting=4, max_num_seqs=64, num_kv_blocks=128)
    url = server.url + "/v1/completions"

    async def one(session, i):
        body = {"model": MODEL, "prompt": f"Item {i}", "max_tokens": 2, "temperature": 0}
        async with session.post(url, json=body) as response:
            return response.status, await response.read()

    async def run():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*[one(session, i) for i in range(20)])

    results = asyncio.run(asyncio.wait_for(run(), 120))
    assert [status for status, _ in results] == [200] * 20, [raw[:200] for _, raw in results]


def _connect(server, timeout: float = 10):
    import socket
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    return sock


def _read_until_closed(sock) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def test_slow_headers_and_slow_bodies_time_out(start_server):
    import time
    server = start_server(settings={"read_timeout": 1.0}, num_kv_blocks=16)
    # slowloris: headers that never end are cut off after the read timeout
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        sock.sendall(b"X-Slow: 1\r\n")
        assert _read_until_closed(sock) == b""
        assert time.monotonic() - start < 5
    # a body that never completes: 408 in OpenAI's shape, then the connection closes
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        raw = _read_until_closed(sock)
        assert time.monotonic() - start < 5
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"application/json" in head, raw
    assert _error(body)["code"] == "request_timeout"
    # an idle keep-alive connection is closed too; a prompt request is still served
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = _read_until_closed(sock)
    assert raw.startswith(b"HTTP/1.1 200")


def test_read_timeout_flag():
    from ember_cupy import cli
    from ember_cupy.server import ServerSettings
    assert ServerSettings().read_timeout == 30.0
    args = cli.build_parser().parse_args(["serve", "--read-timeout", "5"])
    assert args.read_timeout == 5.0


def test_tokenizing_a_huge_prompt_does_not_block_the_event_loop(start_server):
    """The prompt is tokenized in a worker thread (and the tokenizer releases the GIL there):
    /health keeps answering meanwhile."""
    import threading
    import time

    from server_helpers import http
    server = start_server(settings={"max_body_bytes": 8 << 20}, num_kv_blocks=16)
    prompt = "hello world " * 200_000          # 2.4 MB: about a second or more to tokenize
    result = {}

    def big():
        start = time.monotonic()
        result["status"], _, result["raw"] = http(server.url, "POST", "/v1/completions",
                                                  {"prompt": prompt, "max_tokens": 1}, timeout=300)
        result["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=big)
    latencies = []
    thread.start()
    time.sleep(0.05)
    while thread.is_alive():
        start = time.monotonic()
        assert http(server.url, "GET", "/health", timeout=300)[0] == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.01)
    thread.join()
    assert result["status"] == 400 and _error(result["raw"])["param"] == "prompt"   # too long for the context
    assert len(latencies) >= 3, (result["seconds"], latencies)
    assert max(latencies) < max(0.3, result["seconds"] / 4), (result["seconds"], max(latencies))


BAD_HTTP = {
    "bad-request-line": b"GET /health HTTP/1.1 junk\r\nHost: x\r\n\r\n",
    "bad-method": b"G@T /health HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad-chunk-size": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "te-with-content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
    "8kb-header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
}


def test_http_parser_errors_are_openai_json_and_one_log_line(server, caplog):
    import logging
    caplog.set_level(logging.DEBUG)
    for name, data in BAD_HTTP.items():
        caplog.clear()
        with _connect(server) as sock:
            sock.sendall(data)
            raw = _read_until_closed(sock)
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0].split(b" ")[1] == b"400", (name, raw[:300])
        assert b"application/json" in head, (name, head)
        error = _error(body)
        assert error["type"] == "invalid_request_error" and error["code"] == "bad_http_request", error
        assert b"aaaaaaaaaa" not in body and len(error["message"]) < 300, error
        records = [r for r in caplog.records if r.name.startswith(("aiohttp", "ember_cupy"))
                   and r.levelno >= logging.INFO]
        assert len(records) == 1, (name, [r.getMessage()[:200] for r in records])
        record = records[0]
        assert record.exc_info is None and "\n" not in record.getMessage(), record.getMessage()
        assert len(record.getMessage()) < 300 and "aaaaaaaaaa" not in record.getMessage()


def test_a_client_that_leaves_mid_body_is_not_logged_as_an_error(server, caplog):
    """Found by tools/soak.py: a stream dropped while its body was being read logged an ERROR
    traceback ("unhandled error ... ConnectionResetError") for every such client."""
    import logging
    import time
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        with _connect(server) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": \"Hi")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any("went away" in r.getMessage() for r in caplog.records):
        time.sleep(0.05)
    assert any("went away" in r.getMessage() for r in caplog.records)
    loud = [r.getMessage()[:200] for r in caplog.records
            if r.name.startswith(("aiohttp", "ember_cupy")) and r.levelno >= logging.WARNING]
    assert loud == []


KEY = "sekret-key"


def test_bearer_scheme_is_case_insensitive(start_server):
    from server_helpers import http
    server = start_server(settings={"api_key": KEY}, num_kv_blocks=16)
    for value in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"bEaReR  {KEY}"):
        assert http(server.url, "GET", "/v1/models", headers={"Authorization": value})[0] == 200, value
    for value in (KEY, f"Basic {KEY}", f"Bearer {KEY}x", "Bearer", f"Bearer{KEY}"):
        status, _, raw = http(server.url, "GET", "/v1/models", headers={"Authorization": value})
        assert status == 401 and _error(raw)["code"] == "invalid_api_key", value


def test_the_routes_left_public_by_api_key_are_documented(capsys):
    import os

    import pytest

    from ember_cupy import cli
    from ember_cupy.server.api import ServerSettings, build_app
    from ember_cupy.server.async_engine import AsyncEngine
    from ember_cupy.server.middleware import PROTECTED_PREFIXES
    app = build_app(AsyncEngine(factory=lambda: None), ServerSettings(api_key="k"))
    routes = {r.canonical for r in app.router.resources()}
    public = {r for r in routes if not r.startswith(PROTECTED_PREFIXES)}
    assert public == {"/health", "/metrics", "/version", "/openapi.json", "/", "/docs"}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    api_key_help = help_text[help_text.rindex("--api-key"):][:600]     # its entry, not the usage line
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    paragraph = " ".join(line for line in readme.splitlines() if "--api-key" in line or "public" in line)
    for route in sorted(public) + ["/v1/", "/tokenize", "/detokenize"]:
        assert route in api_key_help, (route, api_key_help)
        assert route in paragraph, (route, paragraph)


def test_metrics_gauges_reflect_the_step_being_computed(checkpoint):
    """Two requests admitted together are computing while the step runs: the gauges say so then,
    not one step later."""
    import re
    import threading

    from ember_cupy.config import EngineConfig
    from ember_cupy.engine.llm_engine import LLMEngine
    from ember_cupy.sampling_params import SamplingParams
    from ember_cupy.server import AsyncEngine, EngineMetrics

    class GatedEngine(LLMEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.entered, self.gate = threading.Event(), threading.Event()
            execute = self.runner.execute

            def gated(batch):
                self.entered.set()
                self.gate.wait(30)
                return execute(batch)
            self.runner.execute = gated

    def gauge(engine, name):
        text = engine.metrics.render().decode()
        return float(re.search(rf"^ember:{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))

    async def run():
        llm_engine = GatedEngine(checkpoint, EngineConfig(num_kv_blocks=16))
        engine = AsyncEngine(llm_engine, metrics=EngineMetrics(MODEL))
        await engine.start()
        try:
            params = SamplingParams(max_tokens=2, temperature=0)
            streams = await asyncio.gather(engine.add_request([1, 2, 3], params),
                                           engine.add_request([4, 5, 6], params))
            assert await asyncio.to_thread(llm_engine.entered.wait, 30)
            during = gauge(engine, "num_requests_running"), gauge(engine, "num_requests_waiting")
            llm_engine.gate.set()
            for stream in streams:
                async for _ in stream:
                    pass
            after = gauge(engine, "num_requests_running"), gauge(engine, "num_requests_waiting")
            return during, after
        finally:
            llm_engine.gate.set()
            await engine.shutdown()

    during, after = asyncio.run(asyncio.wait_for(run(), 120))
    assert during == (2.0, 0.0)
    assert after == (0.0, 0.0)


def test_a_long_text_is_tokenized_in_pieces_to_the_ids_of_the_whole(start_server, checkpoint, monkeypatch):
    """/tokenize of 0.5 MB: the ids (and token strings) of the whole text, sent in JSON built in
    slices, though `tokenizers` never saw more than a piece of it (a whole 4 MB text once held
    ~260 MB and the GIL for 0.15 s at a stretch)."""
    import os
    import sys

    from server_helpers import http

    from ember_cupy import text_pieces
    from ember_cupy.tokenizer import Tokenizer
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    old_interval = sys.getswitchinterval()
    server = start_server(settings={"max_body_bytes": 8 << 20}, num_kv_blocks=16)
    tokenizer = checkpoint.tokenizer
    text = "".join(f"Line {i}: naïve café, déjà vu — {i * 7919 % 1000} apples!\n\tand  more words "
                   for i in range(6000))
    expected = tokenizer._encode(text, True)
    seen = []
    original = Tokenizer._encode

    def recording(self, piece, add_special_tokens):
        seen.append(len(piece))
        return original(self, piece, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "_encode", recording)
    status, _, raw = http(server.url, "POST", "/tokenize", {"prompt": text, "return_token_strs": True}, timeout=300)
    assert status == 200, raw[:300]
    body = json.loads(raw)
    assert body["count"] == len(expected) and body["tokens"] == expected
    assert body["token_strs"] == [tokenizer.id_to_token(i) for i in expected]
    assert raw == json.dumps(body).encode()   # the bytes json.dumps writes, slices or not
    assert len(seen) > 20 and max(seen) < 2 * text_pieces.PIECE_CHARS
    # the process-wide thread policy the server set (server/thread_policy.py)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(old_interval)
    assert interval <= 0.0005 and os.environ.get("TOKENIZERS_PARALLELISM") == "false"


def test_the_grammar_tokenizer_is_built_at_start_up_not_in_the_first_constrained_request(start_server):
    """llguidance's tokenizer holds the GIL ~0.3 s while it is built: a started server builds it
    on a grammar worker before any constrained request, so none stalls the running ones."""
    import time
    server = start_server(num_kv_blocks=16)
    grammars = server.engine.engine.grammars
    deadline = time.monotonic() + 60
    while grammars._ll_tokenizer is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert grammars._ll_tokenizer is not None
