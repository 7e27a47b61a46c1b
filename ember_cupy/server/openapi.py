"""GET /openapi.json: an OpenAPI 3.1 description of every route the server has."""
from __future__ import annotations

_ERROR = {"$ref": "#/components/schemas/Error"}


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict:
    text = {400: "Bad request", 401: "Missing or wrong API key", 404: "Unknown model", 413: "Body too large",
            415: "Content-Type is not application/json", 503: "Loading, dead, or overloaded (Retry-After)"}
    return {str(s): {"description": text[s], **_json(_ERROR)} for s in statuses}


_NUM = {"type": "number"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_STOP = {"oneOf": [_STR, {"type": "array", "items": _STR}]}
_SAMPLING = {
    "model": _STR, "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL,
                                                        "continuous_usage_stats": _BOOL}},
    "n": {**_INT, "minimum": 1}, "temperature": {**_NUM, "minimum": 0},
    "top_p": {**_NUM, "exclusiveMinimum": 0, "maximum": 1}, "top_k": _INT,
    "min_p": {**_NUM, "minimum": 0, "maximum": 1},
    "presence_penalty": {**_NUM, "minimum": -2, "maximum": 2},
    "frequency_penalty": {**_NUM, "minimum": -2, "maximum": 2},
    "repetition_penalty": {**_NUM, "exclusiveMinimum": 0},
    "logit_bias": {"type": "object", "additionalProperties": {**_NUM, "minimum": -100, "maximum": 100}},
    "seed": _INT, "max_tokens": {**_INT, "minimum": 1}, "min_tokens": {**_INT, "minimum": 0},
    "stop": _STOP, "stop_token_ids": {"type": "array", "items": _INT}, "ignore_eos": _BOOL,
    "include_stop_str_in_output": _BOOL, "skip_special_tokens": _BOOL,
    "priority": _INT, "cache_salt": _STR, "user": _STR,
}
_PROMPT = {"oneOf": [_STR, {"type": "array", "items": _STR}, {"type": "array", "items": _INT},
                     {"type": "array", "items": {"type": "array", "items": _INT}}]}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "user", "assistant", "tool", "developer"]},
    "content": {"oneOf": [_STR, {"type": "array", "items": {"type": "object"}}]}}}
_USAGE = {"type": "object", "properties": {
    "prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": _INT}}}}

SCHEMAS = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": _STR, "type": _STR, "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}}},
    "CompletionRequest": {"type": "object", "required": ["prompt"], "additionalProperties": False,
                          "properties": {**_SAMPLING, "prompt": _PROMPT, "echo": _BOOL,
                                         "logprobs": {**_INT, "minimum": 0, "maximum": 20}}},
    "ChatCompletionRequest": {"type": "object", "required": ["messages"], "additionalProperties": False,
                              "properties": {**_SAMPLING, "messages": {"type": "array", "minItems": 1,
                                                                       "items": _MESSAGE},
                                             "max_completion_tokens": {**_INT, "minimum": 1},
                                             "logprobs": _BOOL,
                                             "top_logprobs": {**_INT, "minimum": 0, "maximum": 20},
                                             "response_format": {"type": "object", "properties": {
                                                 "type": {"enum": ["text"]}}},
                                             "add_generation_prompt": _BOOL}},
    "Usage": _USAGE,
    "Completion": {"type": "object", "properties": {
        "id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR,
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            "index": _INT, "text": _STR, "logprobs": {"type": ["object", "null"]},
            "finish_reason": {"enum": ["stop", "length", "abort", None]}}}},
        "usage": {"$ref": "#/components/schemas/Usage"}}},
    "ChatCompletion": {"type": "object", "properties": {
        "id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR,
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            "index": _INT, "message": {"type": "object", "properties": {"role": _STR, "content": _STR}},
            "logprobs": {"type": ["object", "null"]},
            "finish_reason": {"enum": ["stop", "length", "abort", None]}}}},
        "usage": {"$ref": "#/components/schemas/Usage"}}},
}


def _generation(summary: str, request: str, response: str) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, **_json({"$ref": f"#/components/schemas/{request}"})},
        "responses": {"200": {"description": "The result, or with stream=true a text/event-stream of "
                                             "chunks ending with `data: [DONE]`",
                              **_json({"$ref": f"#/components/schemas/{response}"}),
                              },
                      **_errors(400, 401, 404, 413, 415, 503)}}}


def _get(summary: str, content_type: str = "application/json") -> dict:
    return {"get": {"summary": summary, "responses": {"200": {
        "description": "OK", "content": {content_type: {"schema": {"type": "object"}
                                                       if content_type == "application/json" else _STR}}}}}}


def openapi_spec(version: str) -> dict:
    health = _get("200 when the engine is ready")
    health["get"]["responses"].update(_errors(503))
    tokenize = {"post": {"summary": "Text or chat messages to token ids", "requestBody": _json({
        "type": "object", "properties": {"model": _STR, "prompt": _STR, "messages": {"type": "array"},
                                         "add_special_tokens": _BOOL, "add_generation_prompt": _BOOL,
                                         "return_token_strs": _BOOL}}),
        "responses": {"200": {"description": "count, max_model_len, tokens", **_json({"type": "object"})},
                      **_errors(400, 401, 503)}}}
    detokenize = {"post": {"summary": "Token ids to text", "requestBody": _json({
        "type": "object", "required": ["tokens"], "properties": {"model": _STR,
                                                                 "tokens": {"type": "array", "items": _INT}}}),
        "responses": {"200": {"description": "prompt", **_json({"type": "object"})}, **_errors(400, 401, 503)}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "ember-cupy", "version": version,
                 "description": "OpenAI-compatible LLM inference server"},
        "components": {"schemas": SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/completions": _generation("Text completion", "CompletionRequest", "Completion"),
            "/v1/chat/completions": _generation("Chat completion with the model's chat template",
                                                "ChatCompletionRequest", "ChatCompletion"),
            "/v1/models": _get("The served models"),
            "/v1/models/{model}": _get("One served model"),
            "/health": health,
            "/metrics": _get("Prometheus metrics (ember:* names)", "text/plain"),
            "/version": _get("Server version"),
            "/tokenize": tokenize,
            "/detokenize": detokenize,
            "/openapi.json": _get("This document"),
        },
    }
