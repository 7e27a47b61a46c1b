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
