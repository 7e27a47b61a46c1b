"""Error messages are one bounded line: no parser's echo of the input or caret line, no
traceback, no Rust panic's location or backtrace hint, whatever a library's exception says."""
from __future__ import annotations

import json
import time

import pytest
from server_helpers import MODEL, http

from ember_cupy.engine.llm_engine import LLMEngine
from ember_cupy.server.errors import MAX_MESSAGE_CHARS

PANIC = ("thread '<unnamed>' panicked at src/matcher.rs:88:14:\ncalled `Option::unwrap()` on a `None` value\n"
         "note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n"
         "Traceback (most recent call last):\n  File \"ember_cupy/engine/sampler.py\", line 12, in sample\n"
         "    mask = matcher.compute()\n" + "x" * 2000)


def _message(raw: bytes) -> str:
    message = json.loads(raw)["error"]["message"]
    assert "\n" not in message and "\r" not in message and len(message) <= MAX_MESSAGE_CHARS, message
    return message


def _chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


@pytest.mark.parametrize("constraint, what", [
    ({"regex": "((((["}, "unclosed character class"),        # the regex crate's multi-line report
    ({"grammar": "start: %%%% ((("}, "lexer error"),           # llguidance's, with the grammar's line
])
def test_a_grammar_error_is_one_line_without_the_echo(base_url, constraint, what):
    status, _, raw = http(base_url, "POST", "/v1/chat/completions", _chat(structured_outputs=constraint))
    message = _message(raw)
    assert status == 400 and what in message and "^" not in message and " | " not in message, message


def test_a_long_message_is_truncated(base_url):
    status, _, raw = http(base_url, "GET", "/v1/models/" + "m" * 3000)
    message = _message(raw)
    assert status == 404 and message.startswith("the model 'mmm") and message.endswith("..."), message


class _PanickingEngine(LLMEngine):
    """Fails its first step with a Rust panic's text wrapped in a Python traceback."""

    def step(self):
        if self.requests:
            raise RuntimeError(PANIC)
        time.sleep(0.01)
        return []


def test_a_dead_engines_error_quotes_no_panic_or_traceback(start_server):
    url = start_server(engine_factory=_PanickingEngine, num_kv_blocks=16).url
    status, _, raw = http(url, "POST", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2})
    assert status == 503
    for raw in (raw, http(url, "GET", "/health")[2]):
        message = _message(raw)
        assert "called `Option::unwrap()` on a `None` value" in message, message
        for wrapping in ("panicked at", "RUST_BACKTRACE", "Traceback", 'File "', "matcher.compute"):
            assert wrapping not in message, message
