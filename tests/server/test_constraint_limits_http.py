"""What a constraint may cost the server, over HTTP on the real model: deep grammars never kill it
(a separate `ember-cupy serve` process, so a crash fails the test, not the session), a grammar too
large to keep is a 400 naming the limit, an empty language is a 400, a grammar that fails mid-way
ends with finish_reason "error", and refusals stay short in replies and logs."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
from server_helpers import MODEL, free_port, http, parallel

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def defs_chain(n: int) -> dict:
    """The issue's schema: n chained $defs, each a const or the next (a frame per link to compile)."""
    defs = {f"d{i}": {"anyOf": [{"const": f"t{i}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(n)}
    defs[f"d{n}"] = {"const": "end"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int) -> str:
    """The issue's grammar: n chained rules r{i}: "t{i}" | r{i+1}."""
    return "\n".join(["start: r0"] + [f'r{i}: "t{i}" | r{i + 1}' for i in range(n)] + [f'r{n}: "end"'])


def chat(base_url, **fields):
    status, _, body = http(base_url, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Say t5."}], "max_tokens": 4,
        "temperature": 0, **fields}, timeout=120)
    return status, json.loads(body)


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "chain", "schema": schema}}


# --- deep constraints: the server stays up -----------------------------------------------------------------
@pytest.fixture(scope="module")
def serve_process():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "EMBER_BACKEND": "numpy", "EMBER_PORT": str(port), "EMBER_KV_CACHE_MEMORY": "24MiB",
           "EMBER_NO_PROGRESS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ember_cupy.cli", "serve", "--served-model-name", MODEL],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server did not start"
        try:
            if http(url, "GET", "/health", timeout=2)[0] == 200:
                break
        except OSError:
            time.sleep(0.3)
    yield proc, url
    proc.terminate()
    proc.wait(timeout=60)


def _deep_requests():
    """(name, path, body): the issue's shapes on every way in, then 10x larger ones."""
    ask = [{"role": "user", "content": "Say t5."}]
    chat_body = {"model": MODEL, "messages": ask, "max_tokens": 2, "temperature": 0}
    yield "chat response_format, 2,000 $defs", "/v1/chat/completions", {
        **chat_body, "response_format": json_format(defs_chain(2000))}
    yield "chat structured_outputs, 3,000 rules", "/v1/chat/completions", {
        **chat_body, "structured_outputs": {"grammar": lark_chain(3000)}}
    yield "completions structured_outputs, 2,000 $defs", "/v1/completions", {
        "model": MODEL, "prompt": "Say t5:", "max_tokens": 2, "structured_outputs": {"json": defs_chain(2000)}}
    yield "responses text.format, 2,000 $defs", "/v1/responses", {
        "model": MODEL, "input": "Say t5.", "max_output_tokens": 2,
        "text": {"format": {"type": "json_schema", "name": "chain", "schema": defs_chain(2000)}}}
    yield "completions, 30,000 rules", "/v1/completions", {
        "model": MODEL, "prompt": "Say t5:", "max_tokens": 1, "structured_outputs": {"grammar": lark_chain(30000)}}
    yield "chat, 20,000 $defs", "/v1/chat/completions", {
        **chat_body, "response_format": json_format(defs_chain(20000))}


def test_deep_constraints_never_kill_the_server(serve_process):
    """~1,250 chained $defs or ~2,650 chained rules overflowed the 8 MiB stack of the compiling
    thread: SIGSEGV, exit 139, every request lost. Now each is answered and the server lives on."""
    proc, url = serve_process
    for name, path, body in _deep_requests():
        try:
            status, _, raw = http(url, "POST", path, body, timeout=300)
        except OSError as exc:   # the connection dropped: did the server die?
            time.sleep(2)
            status, raw = None, str(exc).encode()
        assert proc.poll() is None, f"{name}: the server died with status {proc.returncode}"
        assert status in (200, 400), (name, status, raw[:300])
        if status == 400:
            assert len(json.loads(raw)["error"]["message"]) < 400, name
    status, _, raw = http(url, "POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert status == 200, raw


# --- compiled size ------------------------------------------------------------------------------------------
def test_a_grammar_too_large_to_keep_is_a_400_naming_the_limit(base_url):
    """A 15-byte regex whose lexer takes ~166 MiB: refused, not kept in the grammar cache."""
    status, body = chat(base_url, structured_outputs={"regex": "(a{1000}){1000}"})
    assert status == 400, body
    assert "the limit is 128 MiB per constraint" in body["error"]["message"]


# --- grammars whose mask steps would be slow ------------------------------------------------------------
def test_a_grammar_too_large_to_step_fast_is_a_400_and_a_request_beside_it_completes(serve_process):
    """A Lark chain of 17,000 rules is 34,000 grammar symbols: llguidance's first parser row
    predicts every rule, unchecked by its row limit, so its masks took seconds (30,000 rules: ~8 s
    per request's first step, in the engine's step, stalling every request in the batch). It is
    refused before it is built, naming the limit; an ordinary request sent beside it is answered
    as when sent alone (the server of the default settings: the grammar is 390 KB)."""
    base_url = serve_process[1]
    ask = {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 8}
    alone = chat(base_url, **ask)
    slow_grammar, beside = parallel(lambda: chat(base_url, structured_outputs={"grammar": lark_chain(17000)}),
                                    lambda: chat(base_url, **ask))
    status, body = slow_grammar
    assert status == 400, body
    assert "the limit is 32768 symbols per constraint" in body["error"]["message"]
    assert beside[0] == 200 and alone[0] == 200
    assert beside[1]["choices"][0]["message"] == alone[1]["choices"][0]["message"]
    assert beside[1]["choices"][0]["finish_reason"] == alone[1]["choices"][0]["finish_reason"]


# --- empty languages ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("constraint", [
    {"regex": r"[^\s\S]"},
    {"json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
    {"grammar": "start: x\nx: x"},
    {"grammar": "root ::= root"},
])
def test_an_empty_language_is_a_400(base_url, constraint):
    status, body = chat(base_url, structured_outputs=constraint)
    assert status == 400, body
    assert "matches no text" in body["error"]["message"]


# --- a grammar that fails mid-way ---------------------------------------------------------------------------
FAILS_AT_ONCE = json_format(defs_chain(1100))   # its first token makes a parser row of 2,201 items (max 2,000)


def test_a_grammar_failing_mid_generation_ends_with_finish_reason_error(base_url):
    status, body = chat(base_url, response_format=FAILS_AT_ONCE)
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "error"
    assert choice["message"]["content"] == ""   # the refused token is not written


def test_a_streamed_grammar_failure_ends_with_finish_reason_error(base_url):
    status, _, raw = http(base_url, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Say t5."}], "max_tokens": 4, "stream": True,
        "response_format": FAILS_AT_ONCE})
    assert status == 200
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "error"


def test_a_responses_grammar_failure_is_a_failed_response(base_url):
    status, _, raw = http(base_url, "POST", "/v1/responses", {
        "model": MODEL, "input": "Say t5.", "max_output_tokens": 4,
        "text": {"format": {"type": "json_schema", "name": "chain", "schema": defs_chain(1100)}}})
    assert status == 200, raw
    reply = json.loads(raw)
    assert reply["status"] == "failed" and reply["error"]["code"] == "server_error"


# --- short refusals -----------------------------------------------------------------------------------------
def test_refusals_are_one_short_line_in_the_reply_and_the_log(base_url, caplog):
    """A 200 KiB regex llguidance quotes whole, and a grammar failure that appends the whole
    grammar, each give one line of at most a few hundred characters."""
    caplog.set_level(logging.INFO, logger="ember_cupy.structured")
    status, body = chat(base_url, structured_outputs={"regex": "(" * 100_000 + "a" + ")" * 100_000})
    assert status == 400, body
    assert len(body["error"]["message"]) < 400 and "\n" not in body["error"]["message"]
    chat(base_url, response_format=FAILS_AT_ONCE)
    records = [r.getMessage() for r in caplog.records if r.name == "ember_cupy.structured"]
    assert len(records) == 2, records
    assert all(len(message) < 500 and "\n" not in message for message in records), records
