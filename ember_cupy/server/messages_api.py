"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat path.

A request is validated (protocol/anthropic.py), mapped to a chat completions body
(messages_chat.py) and prepared by OpenAIServing.prepare_chat as /v1/chat/completions is: the same
prompt, sampling params, tool constraint and output parsers. count_tokens counts that prompt.
Streamed replies are written by messages_stream.py; errors on these routes leave in Anthropic's
shape (anthropic_errors.py, applied by the error middleware)."""
from __future__ import annotations

import logging

from aiohttp import web

from ember_cupy import tool_calls
from ember_cupy.server import anthropic_errors
from ember_cupy.server import messages_chat as M
from ember_cupy.server.async_engine import EngineDeadError, EngineNotReadyError
from ember_cupy.server.errors import constraint_failed
from ember_cupy.server.messages_stream import MessageEvents
from ember_cupy.server.protocol import validate
from ember_cupy.server.protocol.anthropic import CountTokensRequest, MessagesRequest
from ember_cupy.server.request_stream import RequestStream
from ember_cupy.server.serving import OpenAIServing, engine_error
from ember_cupy.server.validation import read_json_body

log = logging.getLogger("ember_cupy.server")
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


class MessagesServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def count_tokens(self, request: web.Request) -> web.Response:
        req = validate(CountTokensRequest, await read_json_body(request))
        _, prompt, _ = await self.serving.prepare_chat(M.chat_body(req))
        token_ids = await self.serving.tokenize_prompts([prompt], "messages", add_special_tokens=False)
        return web.json_response({"input_tokens": len(token_ids[0])})

    async def create(self, request: web.Request) -> web.StreamResponse:
        req = validate(MessagesRequest, await read_json_body(request))
        chat, prompt, tools = await self.serving.prepare_chat(M.chat_body(req))
        token_ids = (await self.serving.tokenize_prompts([prompt], "messages", add_special_tokens=False))[0]
        reply = _Reply(self.serving, M.new_message_id(), req.model, prompt, tools)
        try:
            stream = await self.serving.engine.add_request(prompt, chat.params, request_id=reply.id,
                                                           prompt_token_ids=token_ids)
        except Exception as exc:   # noqa: BLE001 - every admission failure has an HTTP error
            raise engine_error(exc) from None
        try:
            if req.stream:
                return await reply.stream(request, stream, len(token_ids))
            return web.json_response(await reply.full(stream))
        finally:
            stream.close()


class _Reply:
    """One message being made: what its outputs need to become content blocks."""

    def __init__(self, serving: OpenAIServing, message_id: str, model: str, prompt: str,
                 tools: tool_calls.ToolSpec):
        self.id = message_id
        self.model = model
        self.prompt = prompt
        self.tools = tools
        self.parsers = serving.output_parsers
        self.supports_tools = tool_calls.template_supports_tools(serving.engine.tokenizer)

    async def full(self, stream: RequestStream) -> dict:
        try:
            output = await stream.final()
        except (EngineDeadError, EngineNotReadyError) as exc:
            raise engine_error(exc) from None
        c = output.outputs[0]
        if c.finish_reason == "error":
            raise constraint_failed()
        blocks, called = M.content_blocks(c.text, self.prompt, self.parsers, self.tools, self.supports_tools)
        return M.message(self.id, self.model, blocks, M.stop_reason(c.finish_reason, c.stop_reason, called),
                         M.usage(len(output.prompt_token_ids), len(c.token_ids)))

    async def stream(self, request: web.Request, stream: RequestStream, input_tokens: int) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        events = MessageEvents(response, self.id, self.model, self.parsers, self.tools, self.supports_tools,
                               self.prompt)
        try:
            await events.start(input_tokens)
            async for output in stream:
                if await events.feed(output):
                    break
            await response.write_eof()
        except ConnectionError:   # the client went away: create() closes the stream, which aborts it
            log.debug("client disconnected from %s", self.id)
        except (EngineDeadError, EngineNotReadyError) as exc:
            error = engine_error(exc)
            try:
                await events.error(anthropic_errors.error_type(error), error.message)
            except ConnectionError:
                pass
        return response
