"""A request's outputs -> Ollama's reply objects: /api/chat's {"message": ...} and /api/generate's
{"response": ...}, one per delta while streaming (newline-delimited JSON) or one in all.

Thinking (with a --reasoning-parser) and text go out as they come; tool calls (chat) whole once
the output has finished, as on /v1/chat/completions. The last object has done=true, done_reason
and the timings in nanoseconds: total since the request arrived, prompt_eval from the first
scheduling to the first token, eval from there to the last token; /api/generate's also carries
`context`, the prompt's and reply's token ids.
"""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from ember_cupy import tool_calls
from ember_cupy.reasoning import ReasoningStream
from ember_cupy.server.completion_bodies import LogprobFormatter
from ember_cupy.server.output_parsers import OutputParsers

NDJSON = "application/x-ndjson"
# finish_reason -> done_reason ("error", a failed output constraint, becomes an error object instead)
DONE_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def now_rfc3339(seconds: float | None = None) -> str:
    moment = datetime.fromtimestamp(time.time() if seconds is None else seconds, timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


def line(payload: dict) -> bytes:
    return (json.dumps(payload, ensure_ascii=False) + "\n").encode()


def loaded(kind: str, model: str, reason: str = "load") -> dict:
    """The reply to a request that asks for nothing (no messages, an empty prompt): the model is
    loaded (or, reason "unload", unloaded: keep_alive 0 on a --models-dir server)."""
    body = {"model": model, "created_at": now_rfc3339(), "done": True, "done_reason": reason}
    body.update({"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""})
    return body


def _nanoseconds(seconds: float | None) -> int:
    return max(int(round((seconds or 0.0) * 1e9)), 0)


class OllamaReply:
    """The objects of one reply, made as its outputs come (`kind`: "chat" or "generate")."""

    def __init__(self, kind: str, model: str, prompt: str, parsers: OutputParsers, tools: tool_calls.ToolSpec,
                 template_supports_tools: bool, tokenizer, logprobs: bool):
        self.kind = kind
        self.model = model
        self.started = time.monotonic()
        self.thinking = ReasoningStream(parsers.reasoning, prompt) if parsers.reasoning else None
        self.splitter = tool_calls.ToolCallStream(tools, template_supports_tools, parsers.tools)
        self.logprobs = LogprobFormatter(tokenizer) if logprobs else None
        self.prompt_token_ids: list[int] = []
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.metrics = None

    def feed(self, output) -> list[dict]:
        """The objects a delta output makes (none while a tool call or a marker is held back)."""
        c = output.outputs[0]
        self.prompt_token_ids = output.prompt_token_ids
        self.token_ids.extend(c.token_ids)
        self.metrics = output.metrics or self.metrics
        finished = c.finish_reason is not None
        thought, text = self.thinking.feed(c.delta_text, finished) if self.thinking else ("", c.delta_text)
        content, calls = self.splitter.feed(text, finished)
        objects = []
        entries = self.logprobs.chat(c.logprobs)["content"] if self.logprobs and c.logprobs else None
        if thought or content or calls or entries:
            objects.append(self._object(content, thought, calls, entries))
        if finished:
            self.finish_reason = c.finish_reason
            if not self.failed:
                objects.append(self._last())
        return objects

    @property
    def failed(self) -> bool:
        """The output constraint failed mid-way: the reply ends with an error object, not done."""
        return self.finish_reason == "error"

    def whole(self, objects: list[dict]) -> dict:
        """stream=false: the objects of a reply joined into one."""
        text_key = "response" if self.kind == "generate" else "content"
        text = "".join(self._part(o, text_key) for o in objects)
        thinking = "".join(self._part(o, "thinking") for o in objects)
        calls = [call for o in objects for call in (o.get("message", {}).get("tool_calls") or [])]
        entries = [entry for o in objects for entry in (o.get("logprobs") or [])]
        body = self._object(text, thinking, [], entries or None)
        if calls:
            body["message"]["tool_calls"] = calls
        return {**body, **{k: v for k, v in objects[-1].items() if k not in ("message", "response", "thinking")},
                **({"logprobs": entries} if entries else {})}

    def _part(self, body: dict, key: str) -> str:
        holder = body.get("message", {}) if self.kind == "chat" else body
        return holder.get(key) or ""

    def _object(self, content: str, thought: str, calls: list[tool_calls.ToolCall], entries) -> dict:
        body: dict = {"model": self.model, "created_at": now_rfc3339()}
        if self.kind == "chat":
            message = {"role": "assistant", "content": content}
            if thought:
                message["thinking"] = thought
            if calls:
                message["tool_calls"] = [{"id": call.id, "function": {
                    "index": i, "name": call.name, "arguments": json.loads(call.arguments)}}
                    for i, call in enumerate(calls)]
            body["message"] = message
        else:
            body["response"] = content
            if thought:
                body["thinking"] = thought
        body["done"] = False
        if entries:
            body["logprobs"] = entries
        return body

    def _last(self) -> dict:
        body = self._object("", "", [], None)
        body.update(done=True, done_reason=DONE_REASONS.get(self.finish_reason, self.finish_reason),
                    **self._timings())
        if self.kind == "generate":
            body["context"] = list(self.prompt_token_ids) + self.token_ids
        return body

    def _timings(self) -> dict:
        m = self.metrics
        first = m.first_token_time if m is not None else None
        scheduled = m.first_scheduled_time if m is not None else None
        last = (m.last_token_time or m.finished_time) if m is not None else None
        return {"total_duration": _nanoseconds(time.monotonic() - self.started), "load_duration": 0,
                "prompt_eval_count": len(self.prompt_token_ids),
                "prompt_eval_duration": _nanoseconds(first - scheduled if first and scheduled else 0),
                "eval_count": len(self.token_ids),
                "eval_duration": _nanoseconds(last - first if last and first else 0)}
