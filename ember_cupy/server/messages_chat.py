"""Anthropic's Messages API mapped onto chat completions, both ways.

A request becomes a chat completions body: `system` -> a system message; a user message's
tool_result blocks -> `tool` messages (in order, before its text), its text blocks -> one user
message; an assistant message's text -> its content, its tool_use blocks -> its tool_calls
(thinking blocks are left out, as chat templates leave out earlier reasoning); `tools`
({name, description, input_schema}) -> function tools; `tool_choice` auto / any / tool / none ->
"auto" / "required" / the named function / "none", disable_parallel_tool_use -> parallel_tool_calls
false; stop_sequences -> stop; output_config.format (a JSON schema) -> response_format.
OpenAIServing.prepare_chat then builds the prompt, sampling params and output constraint (a forced
tool's input held to its schema) exactly as for /v1/chat/completions.
The other way: a reply's text, reasoning and tool calls -> content blocks, its finish -> stop_reason.
"""
from __future__ import annotations

import json
import uuid

from ember_cupy import tool_calls
from ember_cupy.reasoning import split_reasoning
from ember_cupy.server.errors import bad_request
from ember_cupy.server.output_parsers import OutputParsers
from ember_cupy.server.protocol.anthropic import CountTokensRequest, MessagesRequest

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


# --- request -> chat -------------------------------------------------------------------------------
def chat_body(req: CountTokensRequest) -> dict:
    """The /v1/chat/completions body that asks for what `req` asks for (a MessagesRequest also
    for its sampling fields)."""
    messages = conversation(req.messages)
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        messages.insert(0, {"role": "system", "content": system})
    body: dict = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema}} for t in req.tools]
    body.update(_tool_choice(req))
    output_format = req.output_config.format if req.output_config is not None else None
    if output_format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                          "schema": output_format.json_schema}}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, temperature=req.temperature, stop=req.stop_sequences,
                    top_p=req.top_p, top_k=req.top_k)
    return {k: v for k, v in body.items() if v is not None}


def _tool_choice(req: CountTokensRequest) -> dict:
    choice = req.tool_choice
    if choice is None or not req.tools and choice.type in ("auto", "none"):
        return {}
    if not req.tools:
        raise bad_request(f"tool_choice {{\"type\": \"{choice.type}\"}} needs a non-empty 'tools' list",
                          param="tool_choice")
    fields = {"tool_choice": _TOOL_CHOICES.get(choice.type) or {"type": "function", "function": {"name": choice.name}}}
    if getattr(choice, "disable_parallel_tool_use", None):
        fields["parallel_tool_calls"] = False
    return fields


def conversation(messages) -> list[dict]:
    """Anthropic's messages as chat messages (see the module docstring)."""
    out: list[dict] = []
    for message in messages:
        if message.role == "assistant":
            out.append(_assistant(message.content))
            continue
        for block in message.content:
            if block.type == "tool_result":
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block)})
        texts = [block.text for block in message.content if block.type == "text"]
        if texts or not out or out[-1]["role"] != "tool":
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(blocks) -> dict:
    message: dict = {"role": "assistant"}
    text = "".join(block.text for block in blocks if block.type == "text")
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
             for block in blocks if block.type == "tool_use"]
    if text or not calls:
        message["content"] = text
    if calls:
        message["tool_calls"] = calls
    return message


def _result_text(block) -> str:
    content = block.content or ""
    text = content if isinstance(content, str) else "".join(part.text for part in content)
    return f"Error: {text}" if block.is_error else text


# --- reply -> message ------------------------------------------------------------------------------
def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def thinking_block(thinking: str) -> dict:
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(call: tool_calls.ToolCall, with_input: bool = True) -> dict:
    """A call as a tool_use block (its input left empty for a stream's content_block_start)."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments) if with_input else {}}


def content_blocks(text: str, prompt: str, parsers: OutputParsers, tools: tool_calls.ToolSpec,
                   template_supports_tools: bool) -> tuple[list[dict], bool]:
    """(a whole reply's content blocks: thinking, text, tool_use; whether it called a tool)."""
    blocks = []
    if parsers.reasoning is not None:
        split = split_reasoning(parsers.reasoning, text, prompt)
        text = split.content or ""
        if split.reasoning:
            blocks.append(thinking_block(split.reasoning))
    content, calls = tool_calls.parse_output(text, tools, template_supports_tools, parsers.tools)
    if content:
        blocks.append(text_block(content))
    return blocks + [tool_use_block(call) for call in calls], bool(calls)


def stop_reason(finish_reason: str | None, matched, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of an output that ended with `finish_reason`; `matched` is the
    stop string (or token id) that ended it."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return ("end_turn" if finish_reason else None), None


def usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def message(message_id: str, model: str, content: list[dict], reason: tuple[str | None, str | None],
            token_usage: dict) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "content": content, "model": model,
            "stop_reason": reason[0], "stop_sequence": reason[1], "usage": token_usage}
