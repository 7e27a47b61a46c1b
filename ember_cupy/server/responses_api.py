"""POST /v1/responses: OpenAI's Responses API on the chat path.

A request becomes a chat completions body (instructions -> a system message, input items ->
messages, function_call items -> assistant tool_calls, function_call_output -> tool messages,
text.format -> response_format, flat function tools -> chat tools), which OpenAIServing.prepare_chat
turns into sampling params, output constraint and prompt as for /v1/chat/completions. The output
text is split into a message item and function_call items by the chat path's tool-call parser.
"""
from __future__ import annotations

import logging
import time
import uuid

from aiohttp import web

from ember_cupy import tool_calls
from ember_cupy.reasoning import ReasoningStream, split_reasoning
from ember_cupy.server import completion_bodies as R
from ember_cupy.server.async_engine import EngineDeadError, EngineNotReadyError
from ember_cupy.server.errors import APIError
from ember_cupy.server.protocol import validate
from ember_cupy.server.protocol.responses_api import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ResponsesRequest,
)
from ember_cupy.server.response_store import ResponseStore
from ember_cupy.server.request_stream import RequestStream
from ember_cupy.server.serving import OpenAIServing, engine_error
from ember_cupy.server.validation import read_json_body

log = logging.getLogger("ember_cupy.server")
# chat fields that prepare_chat may name in an error -> the Responses API's
_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore | None = None):
        self.serving = serving
        self.store = store if store is not None else ResponseStore()

    async def create(self, request: web.Request) -> web.StreamResponse:
        req: ResponsesRequest = validate(ResponsesRequest, await read_json_body(request))
        history = self._history(req.previous_response_id)
        messages = history + conversation(req.input)
        try:
            chat, prompt, tools = await self.serving.prepare_chat(chat_body(req, messages))
            token_ids = await self.serving.tokenize_prompts([prompt], "input", add_special_tokens=False)
        except APIError as exc:
            exc.param = _responses_param(exc.param)
            raise
        run = _Run(self.serving, req, chat.model or self.serving.model_names[0], tools)
        run.prompt = prompt
        try:
            stream = await self.serving.engine.add_request(prompt, chat.params, request_id=run.id,
                                                           cache_salt=chat.cache_salt,
                                                           prompt_token_ids=token_ids[0])
        except Exception as exc:   # noqa: BLE001 - every admission failure has an HTTP error
            raise _admission_error(exc, req) from None
        try:
            if req.stream:
                response = await run.stream(request, stream)
            else:
                response = web.json_response(await run.full(stream))
        finally:
            stream.close()
        if req.store and run.body is not None and run.body["status"] != "in_progress":
            self.store.put(run.body, messages + run.assistant_messages())
        return response

    async def retrieve(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{response_id}: a stored response as it was sent."""
        response_id = request.match_info["response_id"]
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(404, f"no stored response with id '{response_id}' ({self._kept()})",
                           param="response_id", code="response_not_found")
        return web.Response(body=entry.body_json, content_type="application/json")

    def _kept(self) -> str:
        return f"responses are kept {self.store.ttl_seconds:.0f} s, at most {self.store.max_responses}"

    def _history(self, previous_response_id: str | None) -> list[dict]:
        if previous_response_id is None:
            return []
        entry = self.store.get(previous_response_id)
        if entry is None:
            raise APIError(400, f"Previous response with id '{previous_response_id}' not found ({self._kept()})",
                           param="previous_response_id", code="previous_response_not_found")
        return entry.messages


def _admission_error(exc: BaseException, req: ResponsesRequest) -> APIError:
    """engine_error's, naming the field whose constraint failed to compile (a bad JSON schema)."""
    error = engine_error(exc)
    if error.param is None and error.message.startswith("structured_outputs"):
        error.param = "text.format" if req.text is not None and req.text.format is not None else "tools"
    return error


def _responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    for chat_name, name in _PARAMS.items():
        if param == chat_name or param.startswith((chat_name + ".", chat_name + "[")):
            return name
    return param


# --- request -> chat -------------------------------------------------------------------------------
def conversation(items) -> list[dict]:
    """Input items as chat messages; consecutive function calls become one assistant message."""
    messages: list[dict] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": item.role, "content": content})
    return messages


def chat_body(req: ResponsesRequest, messages: list[dict]) -> dict:
    """The /v1/chat/completions body that asks for what `req` asks for."""
    if req.instructions is not None:
        messages = [{"role": "system", "content": req.instructions}] + messages
    body = {"model": req.model, "messages": messages, "temperature": req.temperature, "top_p": req.top_p,
            "max_tokens": req.max_output_tokens, "parallel_tool_calls": req.parallel_tool_calls}
    text_format = req.text.format if req.text is not None else None
    if text_format is not None and text_format.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif text_format is not None and text_format.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.name, "schema": text_format.json_schema, "strict": text_format.strict,
            "description": text_format.description}}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    return {k: v for k, v in body.items() if v is not None}


# --- outputs -> response ---------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _message_item(item_id: str, text: str, status: str) -> dict:
    status = "incomplete" if status == "failed" else status
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call: tool_calls.ToolCall, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": arguments, "status": status}


def _item_status(status: str) -> str:
    return "incomplete" if status == "failed" else status


def _status(finish_reason: str | None) -> str:
    return {"length": "incomplete", "abort": "cancelled", "error": "failed",
            None: "in_progress"}.get(finish_reason, "completed")


# finish_reason "error": the output constraint failed mid-way (its text stops before that token)
CONSTRAINT_FAILED = {"code": "server_error",
                     "message": "the output constraint failed during generation (a limit of the grammar engine)"}


class _Run:
    """One response being made: its id, the items so far, and the body sent at each stage."""

    def __init__(self, serving: OpenAIServing, req: ResponsesRequest, model: str, tools: tool_calls.ToolSpec):
        self.req = req
        self.id = _new_id("resp_")
        self.model = model
        self.created_at = int(time.time())
        self.tools = tools
        self.supports_tools = tool_calls.template_supports_tools(serving.engine.tokenizer)
        self.parsers = serving.output_parsers
        self.prompt = ""                   # the chat prompt: whether it opened the thinking
        self.reasoning: str | None = None
        self.message_index = 0             # the message item's output index (after a reasoning item)
        self.counter = R.UsageCounter()
        self.items: list[dict] = []
        self.text: str | None = None
        self.calls: list[tool_calls.ToolCall] = []
        self.body: dict | None = None
        self._sequence = 0

    # --- whole ---
    async def full(self, stream: RequestStream) -> dict:
        try:
            output = await stream.final()
        except (EngineDeadError, EngineNotReadyError) as exc:
            raise engine_error(exc) from None
        self.counter.add(0, output)
        c = output.outputs[0]
        status = _status(c.finish_reason)
        text = c.text
        if self.parsers.reasoning is not None:
            split = split_reasoning(self.parsers.reasoning, text, self.prompt)
            text = split.content or ""
            if split.reasoning:
                self.reasoning = split.reasoning
                self.items.append(_reasoning_item(_new_id("rs_"), split.reasoning, _item_status(status)))
        content, self.calls = tool_calls.parse_output(text, self.tools, self.supports_tools, self.parsers.tools)
        if content or not self.calls:
            self.text = content or ""
            self.items.append(_message_item(_new_id("msg_"), self.text, status))
        self.items += [_call_item(_new_id("fc_"), call, call.arguments, "completed") for call in self.calls]
        return self._snapshot(status)

    def _snapshot(self, status: str) -> dict:
        req = self.req
        text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {}
        choice = req.tool_choice or "auto"
        self.body = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": list(self.items),
            "usage": None if status == "in_progress" else self._usage(),
            "error": CONSTRAINT_FAILED if status == "failed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "store": req.store,
            "text": {"format": {"type": "text"}, **text},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "metadata": req.metadata or {}, "truncation": "disabled"}
        return self.body

    def _usage(self) -> dict:
        counted = self.counter.body()
        return {"input_tokens": counted["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": counted["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": counted["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": counted["total_tokens"]}

    def assistant_messages(self) -> list[dict]:
        """This response's output as the chat message a later turn's prompt shows."""
        message: dict = {"role": "assistant"}
        if self.text is not None:
            message["content"] = self.text
        if self.calls:
            message["tool_calls"] = [c.to_openai() for c in self.calls]
        return [message] if len(message) > 1 else []

    # --- streamed ---
    async def stream(self, request: web.Request, stream: RequestStream) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await response.prepare(request)
        try:
            await self._events(response, stream)
            await response.write_eof()
        except ConnectionError:   # the client went away: create() closes the stream, which aborts it
            log.debug("client disconnected from %s", self.id)
        except (EngineDeadError, EngineNotReadyError) as exc:
            error = engine_error(exc)
            try:
                await self._emit(response, "error", code=error.code, message=error.message, param=None)
            except ConnectionError:
                pass
        return response

    async def _emit(self, sse_response: web.StreamResponse, kind: str, **fields) -> None:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        await sse_response.write(f"event: {kind}\n".encode() + R.sse(payload))

    async def _events(self, response: web.StreamResponse, stream: RequestStream) -> None:
        await self._emit(response, "response.created", response=self._snapshot("in_progress"))
        await self._emit(response, "response.in_progress", response=self._snapshot("in_progress"))
        splitter = tool_calls.ToolCallStream(self.tools, self.supports_tools, self.parsers.tools)
        thinking = ReasoningStream(self.parsers.reasoning, self.prompt) if self.parsers.reasoning else None
        message_id, reasoning_id, status = None, None, "in_progress"
        async for output in stream:
            self.counter.add(0, output)
            c = output.outputs[0]
            text = c.delta_text
            if thinking is not None:
                thought, text = thinking.feed(text, bool(c.finish_reason))
                if thought:
                    if reasoning_id is None:
                        reasoning_id = await self._open_reasoning(response)
                    self.reasoning += thought
                    await self._emit(response, "response.reasoning_text.delta", item_id=reasoning_id,
                                     output_index=0, content_index=0, delta=thought)
                if reasoning_id is not None and (text or c.finish_reason) and self.message_index == 0:
                    await self._close_reasoning(response, reasoning_id, _item_status(_status(c.finish_reason))
                                                if c.finish_reason else "completed")
            content, calls = splitter.feed(text, bool(c.finish_reason))
            if content:
                if message_id is None:
                    message_id = await self._open_message(response)
                self.text += content
                await self._emit(response, "response.output_text.delta", item_id=message_id,
                                 output_index=self.message_index, content_index=0, delta=content, logprobs=[])
            if c.finish_reason:
                status = _status(c.finish_reason)
                if message_id is None and not calls:
                    message_id = await self._open_message(response)
                if message_id is not None:
                    await self._close_message(response, message_id, status)
                for call in calls:
                    await self._send_call(response, call)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status,
                                                                                             "response.failed")
        await self._emit(response, kind, response=self._snapshot(status))

    async def _open_reasoning(self, response: web.StreamResponse) -> str:
        reasoning_id = _new_id("rs_")
        self.reasoning = ""
        self.items.append(_reasoning_item(reasoning_id, "", "in_progress"))
        await self._emit(response, "response.output_item.added", output_index=0, item=self.items[0])
        return reasoning_id

    async def _close_reasoning(self, response: web.StreamResponse, reasoning_id: str, status: str) -> None:
        """The reasoning is done: its item is closed and the message (if any) comes after it."""
        await self._emit(response, "response.reasoning_text.done", item_id=reasoning_id, output_index=0,
                         content_index=0, text=self.reasoning)
        self.items[0] = _reasoning_item(reasoning_id, self.reasoning, status)
        await self._emit(response, "response.output_item.done", output_index=0, item=self.items[0])
        self.message_index = 1

    async def _open_message(self, response: web.StreamResponse) -> str:
        message_id, index = _new_id("msg_"), self.message_index
        self.text = ""
        self.items.append(_message_item(message_id, "", "in_progress"))
        await self._emit(response, "response.output_item.added", output_index=index, item=self.items[index])
        await self._emit(response, "response.content_part.added", item_id=message_id, output_index=index,
                         content_index=0, part=_text_part(""))
        return message_id

    async def _close_message(self, response: web.StreamResponse, message_id: str, status: str) -> None:
        index = self.message_index
        ids = dict(item_id=message_id, output_index=index, content_index=0)
        await self._emit(response, "response.output_text.done", **ids, text=self.text, logprobs=[])
        await self._emit(response, "response.content_part.done", **ids, part=_text_part(self.text))
        self.items[index] = _message_item(message_id, self.text, status)
        await self._emit(response, "response.output_item.done", output_index=index, item=self.items[index])

    async def _send_call(self, response: web.StreamResponse, call: tool_calls.ToolCall) -> None:
        """A call goes out whole, once its output has finished (its arguments are known valid then)."""
        item_id, index = _new_id("fc_"), len(self.items)
        self.calls.append(call)
        self.items.append(_call_item(item_id, call, "", "in_progress"))
        await self._emit(response, "response.output_item.added", output_index=index, item=self.items[index])
        await self._emit(response, "response.function_call_arguments.delta", item_id=item_id,
                         output_index=index, delta=call.arguments)
        await self._emit(response, "response.function_call_arguments.done", item_id=item_id,
                         output_index=index, name=call.name, arguments=call.arguments)
        self.items[index] = _call_item(item_id, call, call.arguments, "completed")
        await self._emit(response, "response.output_item.done", output_index=index, item=self.items[index])

