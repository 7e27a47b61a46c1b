"""What the HTTP tools (fuzz_http.py, soak.py) hold every response to: OpenAI's error shape (Anthropic's
on /v1/messages, Ollama's on /api/), a well-formed server-sent-event stream (OpenAI's, the
Responses API's, Anthropic's or llama-server's) and a well-formed Ollama NDJSON stream. Each check returns a problem in words, or None."""
from __future__ import annotations

import json

DONE = "[DONE]"
RESPONSES_TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
_SERVER_ERROR_TYPES = {"server_error", "internal_error", "internal_server_error"}
ANTHROPIC_PREFIX = "/v1/messages"     # its routes answer in Anthropic's shapes
OLLAMA_PREFIX = "/api/"               # Ollama's


def error_problem(body) -> str | None:
    """`{"error": {"message": str, "type": str, "param": str|null, "code": str|null}}`, extra keys
    allowed (vLLM and this server add some, e.g. /health's "status")."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return "not an OpenAI error: no 'error' object"
    error = body["error"]
    missing = [key for key in ("message", "type", "param", "code") if key not in error]
    if missing:
        return f"OpenAI error without {', '.join(missing)}"
    if not isinstance(error["message"], str) or not error["message"]:
        return "OpenAI error whose 'message' is not a non-empty string"
    if not isinstance(error["type"], str) or not error["type"]:
        return "OpenAI error whose 'type' is not a non-empty string"
    for key in ("param", "code"):
        if error[key] is not None and not isinstance(error[key], str):
            return f"OpenAI error whose '{key}' is neither a string nor null: {error[key]!r}"
    return None


def anthropic_error_problem(body) -> str | None:
    """`{"type": "error", "error": {"type": str, "message": str}}`."""
    if not isinstance(body, dict) or body.get("type") != "error" or not isinstance(body.get("error"), dict):
        return "not an Anthropic error: no type 'error' with an 'error' object"
    for key in ("type", "message"):
        if not isinstance(body["error"].get(key), str) or not body["error"][key]:
            return f"Anthropic error whose '{key}' is not a non-empty string"
    return None


def error_body_problem(raw: bytes, path: str = "") -> str | None:
    """error_problem() (anthropic_error_problem() on Anthropic's routes) of a response body that
    should be a JSON error."""
    try:
        body = json.loads(raw)
    except ValueError:
        return f"error body is not JSON: {raw[:120]!r}"
    if path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error_problem(body)
    return ollama_error_problem(body) if path.startswith(OLLAMA_PREFIX) else error_problem(body)


def ollama_error_problem(body) -> str | None:
    """`{"error": str}`."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), str) or not body["error"]:
        return "not an Ollama error: no non-empty 'error' string"
    return None


def ndjson_problem(text: str) -> str | None:
    """An Ollama stream: JSON objects a line each, the last one done=true (or an error object,
    which must not be a server's failure)."""
    lines = [line for line in text.split("\n") if line.strip()]
    if not lines:
        return "empty NDJSON stream"
    try:
        objects = [json.loads(line) for line in lines]
    except ValueError:
        return "NDJSON stream with a line that is not JSON"
    if not all(isinstance(o, dict) for o in objects):
        return "NDJSON stream with a line that is not an object"
    last = objects[-1]
    if "error" in last:
        return ollama_error_problem(last) or (f"NDJSON stream ended by an error: {last['error'][:120]}"
                                              if "constraint" not in last["error"] else None)
    if last.get("done") is not True or any(o.get("done") for o in objects[:-1]):
        return "NDJSON stream whose last object, and only it, is not done=true"
    return None


def sse_data(text: str) -> list[str]:
    """The `data:` payloads of an event stream, in order (one per event; multi-line data joined)."""
    events, lines = [], []
    for line in text.replace("\r\n", "\n").split("\n"):
        if line == "":
            if lines:
                events.append("\n".join(lines))
                lines = []
        elif line.startswith("data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(" ") else value)
    if lines:
        events.append("\n".join(lines))
    return events


def event_problem(data: str) -> str | None:
    """One event of a completion stream: `[DONE]`, a chunk with `choices`, or an OpenAI error that
    is not a server error."""
    if data == DONE:
        return None
    try:
        event = json.loads(data)
    except ValueError:
        return f"stream event is not JSON: {data[:120]!r}"
    if isinstance(event, dict) and "error" in event:
        problem = error_problem(event)
        if problem:
            return f"stream error event: {problem}"
        if event["error"]["type"] in _SERVER_ERROR_TYPES:
            return f"stream error event of type {event['error']['type']}: {event['error']['message']}"
        return None
    if not isinstance(event, dict) or not isinstance(event.get("choices"), list):
        return f"stream chunk without a 'choices' array: {data[:120]!r}"
    if not isinstance(event.get("object"), str):
        return "stream chunk without an 'object' string"
    return None


def _completion_stream_problem(events: list[str]) -> str | None:
    """Chat / completion chunks: every event well-formed, the last one `[DONE]` and only the last."""
    for data in events:
        problem = event_problem(data)
        if problem:
            return problem
    if events[-1] != DONE:
        return f"event stream does not end with data: {DONE}"
    if events.count(DONE) != 1:
        return f"event stream has {events.count(DONE)} {DONE} events"
    return None


def _responses_stream_problem(events: list[dict]) -> str | None:
    """Responses API events: typed, numbered 0, 1, 2, ...; one terminal event, the last; each
    response.output_text.done text equal to its deltas joined."""
    deltas: dict[tuple, str] = {}
    for number, event in enumerate(events):
        if not isinstance(event.get("type"), str):
            return f"Responses stream event without a 'type': {json.dumps(event)[:120]}"
        if "sequence_number" in event and event["sequence_number"] != number:
            return f"Responses stream event {number} has sequence_number {event['sequence_number']}"
        if event["type"] == "error" and not isinstance(event.get("message"), str):
            return "Responses stream error event without a 'message'"
        part = (event.get("item_id"), event.get("output_index"), event.get("content_index"))
        if event["type"] == "response.output_text.delta":
            deltas[part] = deltas.get(part, "") + str(event.get("delta", ""))
        elif event["type"] == "response.output_text.done" and event.get("text") != deltas.get(part, ""):
            return (f"response.output_text.done text {event.get('text')!r} differs from its deltas "
                    f"joined {deltas.get(part, '')!r}")
    terminal = [e["type"] for e in events if e["type"] in RESPONSES_TERMINAL]
    if len(terminal) != 1 or events[-1]["type"] not in RESPONSES_TERMINAL:
        return f"Responses stream should end with one of {sorted(RESPONSES_TERMINAL)}, has {terminal}"
    return None


def _messages_stream_problem(events: list[dict]) -> str | None:
    """Anthropic's events: message_start first; content blocks started, delta'd and stopped in
    index order; then message_delta and message_stop, the last (or an error event, the last)."""
    kinds = [event.get("type") for event in events]
    if kinds[-1] == "error":
        problem = anthropic_error_problem(events[-1])
        if problem or events[-1]["error"]["type"] not in ("api_error", "overloaded_error"):
            return f"Anthropic stream error event: {problem or events[-1]['error']}"
        kinds = kinds[:-1]
    elif kinds[-2:] != ["message_delta", "message_stop"] or kinds.count("message_stop") != 1:
        return f"Anthropic stream should end with message_delta, message_stop; has {kinds[-3:]}"
    open_index, next_index = None, 0
    for event in events[1:len(kinds)]:
        kind, index = event.get("type"), event.get("index")
        if kind == "content_block_start":
            if open_index is not None or index != next_index:
                return f"content_block_start {index} while block {open_index} is open (next: {next_index})"
            open_index, next_index = index, index + 1
        elif kind in ("content_block_delta", "content_block_stop"):
            if index != open_index:
                return f"{kind} for block {index}, but the open block is {open_index}"
            open_index = None if kind == "content_block_stop" else open_index
        elif kind not in ("ping", "message_delta", "message_stop"):
            return f"unexpected Anthropic stream event {kind!r}"
    return None


def stream_problem(text: str) -> str | None:
    """A whole event stream, in the chat / completion format, the Responses API's (typed
    events, no [DONE]) or Anthropic's (message_start ... message_stop)."""
    events = sse_data(text)
    if not events:
        return "empty event stream"
    parsed = []
    for data in events:
        try:
            parsed.append(json.loads(data) if data != DONE else None)
        except ValueError:
            return f"stream event is not JSON: {data[:120]!r}"
    if isinstance(parsed[0], dict) and parsed[0].get("type") == "message_start":
        return _messages_stream_problem([e for e in parsed if e is not None])
    if isinstance(parsed[0], dict) and "type" in parsed[0] and "choices" not in parsed[0]:
        return _responses_stream_problem([e for e in parsed if e is not None])   # a [DONE] is harmless
    if isinstance(parsed[0], dict) and "choices" not in parsed[0] and ("stop" in parsed[0] or len(parsed) == 1):
        return _llamacpp_stream_problem(parsed)
    return _completion_stream_problem(events)


def _llamacpp_stream_problem(events: list) -> str | None:
    """llama-server's /completion events: objects, no [DONE]; every event but the last stop=false;
    the last stop=true (or cut by response_fields to fields without it), or an error event that is
    not the server's failure."""
    if not all(isinstance(e, dict) for e in events):
        return f"llama.cpp stream with an event that is not an object (a {DONE}?)"
    last = events[-1]
    if "error" in last:
        problem = error_problem(last)
        if problem or (last["error"]["type"] in _SERVER_ERROR_TYPES and last["error"]["code"] != "constraint_failed"):
            return f"llama.cpp stream error event: {problem or last['error']}"
        events = events[:-1]
    elif last.get("stop", True) is not True:
        return "llama.cpp stream whose last event is not stop=true"
    else:
        events = events[:-1]
    if any(e.get("stop") is not False for e in events):
        return "llama.cpp stream with stop=true (or no stop) before its last event"
    return None
