"""Ollama's requests mapped onto the OpenAI paths' bodies, which then validate, render and sample
exactly as /v1/chat/completions and /v1/completions do.

/api/chat -> a chat body: messages as they are, except an assistant's tool calls (arguments an
object in Ollama's shape, a JSON string in OpenAI's) and a tool message's answer, which is tied
to the earliest unanswered call of its tool_name; images are refused by the protocol model.
/api/generate -> the same chat body for [system, prompt] (Ollama renders the prompt through the
model's template), or with raw=true a completion of the prompt's token ids, `context` before them.
options -> sampling fields (protocol/ollama.py says what each becomes); format -> response_format;
think -> a 400 unless the server splits reasoning (--reasoning-parser), false -> enable_thinking
false for templates that read it.
"""
from __future__ import annotations

import json

from ember_cupy.server.errors import bad_request
from ember_cupy.server.protocol.ollama import OllamaChatRequest, OllamaGenerateRequest, OllamaOptions

LATEST = ":latest"


def served_name(name: str, served: list[str]) -> str | None:
    """The served model `name` means: itself, or itself with Ollama's default tag ":latest"."""
    if name in served:
        return name
    if name.endswith(LATEST) and name[:-len(LATEST)] in served:
        return name[:-len(LATEST)]
    return None


def sampling_fields(options: OllamaOptions | None, max_tokens_name: str = "max_tokens") -> dict:
    """The chat or completion body's sampling fields for Ollama's options."""
    o = options or OllamaOptions()
    fields = {"temperature": o.temperature, "top_p": o.top_p, "min_p": o.min_p, "stop": o.stop,
              "presence_penalty": o.presence_penalty, "frequency_penalty": o.frequency_penalty}
    if o.num_predict is not None and o.num_predict > 0:
        fields[max_tokens_name] = o.num_predict
    if o.top_k is not None:
        fields["top_k"] = max(o.top_k, 0)
    if o.seed is not None and o.seed != -1:
        fields["seed"] = o.seed
    if o.repeat_penalty is not None and o.repeat_last_n != 0:
        fields["repetition_penalty"] = o.repeat_penalty
    return {key: value for key, value in fields.items() if value is not None}


def response_format(output_format) -> dict:
    if output_format is None or output_format == "":
        return {}
    if output_format == "json":
        return {"response_format": {"type": "json_object"}}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": output_format}}}


def thinking_fields(think, splits_reasoning: bool) -> dict:
    if think is None or think is False:
        return {"chat_template_kwargs": {"enable_thinking": False}} if think is False and splits_reasoning else {}
    if not splits_reasoning:
        raise bad_request("'think' needs a server that separates the model's thinking (ember-cupy serve "
                          "--reasoning-parser ...); this one does not", param="think", code="unsupported_parameter")
    return {}


def _logprob_fields(req, kind: str) -> dict:
    if not req.logprobs:
        if req.top_logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
        return {}
    if kind == "chat":
        return {"logprobs": True, "top_logprobs": req.top_logprobs or 0}
    return {"logprobs": req.top_logprobs or 0}


def chat_messages(req: OllamaChatRequest) -> list[dict]:
    """Ollama's messages as chat completions messages (see the module docstring)."""
    out: list[dict] = []
    unanswered: list[tuple[str, str]] = []     # (call id, tool name), oldest first
    for message in req.messages:
        if message.role == "assistant":
            out.append(_assistant(message, len(out), unanswered))
        elif message.role == "tool":
            out.append(_tool_answer(message, unanswered, len(out)))
        else:
            out.append({"role": message.role, "content": message.content})
    return out


def _assistant(message, index: int, unanswered: list[tuple[str, str]]) -> dict:
    turn: dict = {"role": "assistant", "content": message.content}
    calls = []
    for i, call in enumerate(message.tool_calls or []):
        call_id = call.id or f"call_{index}_{i}"
        calls.append({"id": call_id, "type": "function", "function": {
            "name": call.function.name, "arguments": json.dumps(call.function.arguments, ensure_ascii=False)}})
        unanswered.append((call_id, call.function.name))
    if calls:
        turn["tool_calls"] = calls
    return turn


def _tool_answer(message, unanswered: list[tuple[str, str]], index: int) -> dict:
    call_id = message.tool_call_id
    if call_id is None:
        match = next((i for i, (_, name) in enumerate(unanswered)
                      if message.tool_name is None or name == message.tool_name), None)
        call_id = unanswered.pop(match)[0] if match is not None else f"call_answer_{index}"
    else:
        unanswered[:] = [pair for pair in unanswered if pair[0] != call_id]
    answer = {"role": "tool", "tool_call_id": call_id, "content": message.content}
    if message.tool_name is not None:
        answer["name"] = message.tool_name
    return answer


def chat_body(req: OllamaChatRequest | OllamaGenerateRequest, messages: list[dict], splits_reasoning: bool) -> dict:
    """The /v1/chat/completions body that asks for what `req` asks for."""
    body: dict = {"model": req.model, "messages": messages, **sampling_fields(req.options),
                  **response_format(req.format), **thinking_fields(req.think, splits_reasoning),
                  **_logprob_fields(req, "chat")}
    if getattr(req, "tools", None):
        body["tools"] = [tool.model_dump(exclude_none=True) for tool in req.tools]
    return body


def generate_messages(req: OllamaGenerateRequest) -> list[dict]:
    messages = [{"role": "system", "content": req.system}] if req.system is not None else []
    return messages + [{"role": "user", "content": req.prompt}]


def raw_completion_body(req: OllamaGenerateRequest, token_ids: list[int], max_model_len: int,
                        splits_reasoning: bool) -> dict:
    """The /v1/completions body for a raw prompt's token ids: with no num_predict it runs to the
    end of the context, as Ollama's -1 (and OllamaServing stops a num_predict past it there)."""
    if req.system is not None:
        raise bad_request("'system' has no place in a raw prompt (raw=true sends the prompt as it is)",
                          param="system")
    body = {"model": req.model, "prompt": token_ids, **sampling_fields(req.options),
            **response_format(req.format), **_logprob_fields(req, "completion")}
    thinking_fields(req.think or None, splits_reasoning)   # a raw prompt has no template to tell
    body.setdefault("max_tokens", max(max_model_len - len(token_ids), 1))
    return body
