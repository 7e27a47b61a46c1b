"""A streamed /v1/messages reply: a request's delta outputs -> Anthropic's server-sent events.

message_start (the message without content, its input tokens counted), then per content block
content_block_start, content_block_delta (thinking_delta / text_delta / input_json_delta) and
content_block_stop, a ping after the first block starts, message_delta (stop_reason, stop_sequence,
usage.output_tokens) and message_stop. Each event has its `event:` line, as the SDKs read them.
Thinking and text stream as they come; a tool call goes out whole once the output has finished
(its input is known valid only then), as on chat.
"""
from __future__ import annotations

import json

from aiohttp import web

from ember_cupy import tool_calls
from ember_cupy.reasoning import ReasoningStream
from ember_cupy.server import messages_chat as M
from ember_cupy.server.output_parsers import OutputParsers
from ember_cupy.server.completion_bodies import UsageCounter
from ember_cupy.server.errors import CONSTRAINT_FAILED

# finish_reason "error": the output constraint failed mid-way
_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}


def event(kind: str, payload: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n".encode()


class MessageEvents:
    """The events of one message, written to `response` as its outputs come."""

    def __init__(self, response: web.StreamResponse, message_id: str, model: str, parsers: OutputParsers,
                 tools: tool_calls.ToolSpec, template_supports_tools: bool, prompt: str):
        self.response = response
        self.message_id = message_id
        self.model = model
        self.thinking = ReasoningStream(parsers.reasoning, prompt) if parsers.reasoning else None
        self.splitter = tool_calls.ToolCallStream(tools, template_supports_tools, parsers.tools)
        self.counter = UsageCounter()
        self.index = -1                  # the last block's index
        self.open_kind: str | None = None
        self.pinged = False

    async def write(self, kind: str, **payload) -> None:
        await self.response.write(event(kind, payload))

    async def start(self, input_tokens: int) -> None:
        await self.write("message_start", message=M.message(self.message_id, self.model, [], (None, None),
                                                            M.usage(input_tokens, 0)))

    async def feed(self, output) -> bool:
        """One delta output's events; True once the message has ended (message_stop or an error)."""
        self.counter.add(0, output)
        c = output.outputs[0]
        finished = bool(c.finish_reason)
        text = c.delta_text
        if self.thinking is not None:
            thought, text = self.thinking.feed(text, finished)
            await self._stream_into("thinking", thought)
        content, calls = self.splitter.feed(text, finished)
        await self._stream_into("text", content)
        if not finished:
            return False
        await self._close_block()
        if c.finish_reason == "error":
            await self.error("api_error", CONSTRAINT_FAILED)
            return True
        for call in calls:
            await self._tool_use(call)
        if not self.pinged:
            await self._ping()
        reason = M.stop_reason(c.finish_reason, c.stop_reason, bool(calls))
        await self.write("message_delta", delta={"stop_reason": reason[0], "stop_sequence": reason[1]},
                         usage={"output_tokens": self.counter.body()["completion_tokens"]})
        await self.write("message_stop")
        return True

    async def error(self, error_type: str, message: str) -> None:
        await self.write("error", error={"type": error_type, "message": message})

    async def _stream_into(self, kind: str, text: str) -> None:
        if not text:
            return
        if self.open_kind != kind:
            await self._close_block()
            await self._open_block(kind, M.text_block("") if kind == "text" else M.thinking_block(""))
        delta_type, field = _DELTAS[kind]
        await self.write("content_block_delta", index=self.index, delta={"type": delta_type, field: text})

    async def _open_block(self, kind: str, block: dict) -> None:
        self.index += 1
        self.open_kind = kind
        await self.write("content_block_start", index=self.index, content_block=block)
        if not self.pinged:
            await self._ping()

    async def _ping(self) -> None:
        self.pinged = True
        await self.write("ping")

    async def _close_block(self) -> None:
        if self.open_kind is not None:
            await self.write("content_block_stop", index=self.index)
            self.open_kind = None

    async def _tool_use(self, call: tool_calls.ToolCall) -> None:
        await self._open_block("tool_use", M.tool_use_block(call, with_input=False))
        await self.write("content_block_delta", index=self.index,
                         delta={"type": "input_json_delta", "partial_json": call.arguments})
        await self._close_block()
