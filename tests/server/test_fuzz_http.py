"""tools/fuzz_http.py: a short schema fuzz of the real server (spawned as `ember-cupy serve`) finds
nothing, and on a server with defects it reports each one."""
from __future__ import annotations

import json
import os
import sys

import pytest
from defective_server import DefectiveServer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import fuzz_http  # noqa: E402

pytestmark = pytest.mark.fuzz


def _fuzz(tmp_path, *args: str) -> tuple[int, dict]:
    report = tmp_path / "fuzz.json"
    status = fuzz_http.main([*args, "--report", str(report)])
    return status, json.loads(report.read_text())


def test_short_fuzz_of_the_real_server_finds_nothing(tmp_path):
    status, summary = _fuzz(tmp_path, "--cases", "500", "--seed", "1", "--server-log", str(tmp_path / "server.log"))
    shown = json.dumps(summary["failures"][:5], indent=1, ensure_ascii=False)[:6000]
    assert summary["failures"] == [], f"{summary['failure_kinds']}\n{shown}"
    assert summary["after_run_failures"] == []
    assert status == 0
    assert summary["cases"] >= 500
    # the generation endpoints get most cases, and a fair number of them generate text, streamed too
    assert summary["generation_cases"] >= 0.7 * summary["cases"]
    assert summary["generated_200"] >= 60
    assert summary["streamed_200"] >= 20


def test_fuzzer_reports_5xx_plain_text_errors_unterminated_streams_and_leaks(tmp_path):
    with DefectiveServer({"server_error", "plain_errors", "unterminated_stream", "leak"}) as server:
        status, summary = _fuzz(tmp_path, "--url", server.url, "--cases", "80", "--seed", "2",
                                "--idle-timeout", "0.5")
    assert status == 1
    problems = [f for case in summary["failures"] for f in case["failures"]]
    assert any("Server error" in p for p in problems), summary["failure_kinds"]
    assert any("not an OpenAI error" in p or "not JSON" in p for p in problems), summary["failure_kinds"]
    assert any("does not end with data: [DONE]" in p for p in problems), summary["failure_kinds"]
    assert any("not idle" in p and "9/10" in p for p in summary["after_run_failures"])
    # each failing case comes with its request, as a command that reproduces it
    assert all(case["request"]["curl"].startswith("curl ") for case in summary["failures"])


def test_fuzzer_passes_the_same_server_without_defects(tmp_path):
    with DefectiveServer(set()) as server:
        status, summary = _fuzz(tmp_path, "--url", server.url, "--cases", "80", "--seed", "2")
    assert (status, summary["failures"], summary["after_run_failures"]) == (0, [], [])


def _responses_stream(done_text: str, terminal: str = "response.completed") -> str:
    events = [{"type": "response.created"},
              {"type": "response.output_text.delta", "item_id": "m", "output_index": 0, "content_index": 0,
               "delta": "Hel"},
              {"type": "response.output_text.delta", "item_id": "m", "output_index": 0, "content_index": 0,
               "delta": "lo"},
              {"type": "response.output_text.done", "item_id": "m", "output_index": 0, "content_index": 0,
               "text": done_text},
              {"type": terminal}]
    return "".join(f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': i})}\n\n"
                   for i, e in enumerate(events))


def test_responses_stream_check():
    from openai_shapes import stream_problem
    assert stream_problem(_responses_stream("Hello")) is None
    assert "differs from its deltas" in stream_problem(_responses_stream("ello"))
    assert "should end with one of" in stream_problem(_responses_stream("Hello", terminal="response.output_item.done"))


def test_llamacpp_stream_check():
    from openai_shapes import stream_problem

    def stream(*events) -> str:
        return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)
    part, last = {"index": 0, "content": "Hi", "stop": False}, {"index": 0, "content": "", "stop": True}
    assert stream_problem(stream(part, part, last)) is None
    assert stream_problem(stream(part, {"content": ""})) is None      # the last cut by response_fields
    assert "last event is not stop=true" in stream_problem(stream(part, part))
    assert "before its last event" in stream_problem(stream(part, last, last))
    assert "not an object" in stream_problem(stream(part, last, "[DONE]"))
    failed = {"error": {"message": "m", "type": "server_error", "param": None, "code": "internal_error"}}
    assert "stream error event" in stream_problem(stream(part, failed))
    assert stream_problem(stream(part, {"error": {**failed["error"], "code": "constraint_failed"}})) is None


def _messages_stream(*kinds_and_indices) -> str:
    events = [{"type": kind, **({"index": index} if index is not None else {})} for kind, index in kinds_and_indices]
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)


def test_messages_stream_and_error_checks():
    from openai_shapes import error_body_problem, stream_problem
    whole = [("message_start", None), ("content_block_start", 0), ("ping", None), ("content_block_delta", 0),
             ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
             ("content_block_stop", 1), ("message_delta", None), ("message_stop", None)]
    assert stream_problem(_messages_stream(*whole)) is None
    assert "should end with message_delta" in stream_problem(_messages_stream(*whole[:-1]))
    misplaced = _messages_stream(*whole[:6], ("content_block_delta", 0), *whole[7:])
    assert "block 0, but the open block is 1" in stream_problem(misplaced)
    assert "while block 0 is open" in stream_problem(_messages_stream(*whole[:4], *whole[5:]))
    anthropic = json.dumps({"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}).encode()
    openai = json.dumps({"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}})
    assert error_body_problem(anthropic, "/v1/messages") is None
    assert error_body_problem(openai.encode(), "/v1/messages/count_tokens").startswith("not an Anthropic error")
    assert error_body_problem(anthropic, "/v1/chat/completions") == "OpenAI error without param, code"
