"""GET /openapi.json: OpenAPI 3.1 for every route, its schemas generated from the protocol models."""
from __future__ import annotations

import functools
import re

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, models_json_schema

from ember_cupy.server.anthropic_errors import speaks_anthropic
from ember_cupy.server.middleware import PROTECTED_PREFIXES
from ember_cupy.server.ollama_errors import speaks_ollama
from ember_cupy.server.protocol import anthropic as AN
from ember_cupy.server.protocol import embeddings as E
from ember_cupy.server.protocol import llamacpp as LC
from ember_cupy.server.protocol import ollama as O
from ember_cupy.server.protocol import requests as Q
from ember_cupy.server.protocol import replies as A
from ember_cupy.server.protocol import responses_api as RA

REF = "#/components/schemas/{model}"
ERRORS = {400: "Bad request: `param` names the field", 401: "Missing or wrong API key",
          404: "Unknown model", 413: "Body too large", 415: "Content-Type is not application/json",
          500: "The output constraint failed", 503: "Loading, dead, or overloaded (Retry-After)"}
ANTHROPIC_ERRORS = {**ERRORS, 400: "Bad request: the message names the field"}
OLLAMA_ERRORS = {**ANTHROPIC_ERRORS, 404: "Unknown model, or a route of Ollama's model store (not supported)"}
LLAMACPP_STREAM = (" (stream=true: a text/event-stream of LlamaCppCompletion events, one per delta, the last with "
                   "stop=true; no [DONE])")
OLLAMA_STREAM = " (stream=true, the default: newline-delimited JSON, one object per delta, the last with done=true)"
HTML, TEXT = "text/html", "text/plain"   # the responses that are no JSON: their media type
# method, path, summary, request model, response model (or a media type), error statuses
ROUTES = [
    ("post", "/v1/completions", "Text completion", Q.CompletionRequest, A.Completion, (400, 401, 404, 413, 415, 503)),
    ("post", "/v1/chat/completions", "Chat completion with the model's chat template", Q.ChatCompletionRequest,
     A.ChatCompletion, (400, 401, 404, 413, 415, 503)),
    ("post", "/v1/responses", "OpenAI Responses API (stream=true: typed response.* events)", RA.ResponsesRequest,
     RA.ResponseObject, (400, 401, 404, 413, 415, 503)),
    ("get", "/v1/responses/{response_id}", "A stored response", None, RA.ResponseObject, (401, 404)),
    ("post", "/v1/messages", "Anthropic Messages API (stream=true: Anthropic's message_start ... message_stop "
     "events); errors in Anthropic's shape", AN.MessagesRequest, AN.MessageResponse, (400, 401, 404, 413, 415, 503)),
    ("post", "/v1/messages/count_tokens", "The prompt tokens of a /v1/messages request with these fields",
     AN.CountTokensRequest, AN.CountTokensResponse, (400, 401, 404, 413, 415, 503)),
    ("post", "/v1/embeddings", f"Embeddings of the inputs. {E.POOLING_DESCRIPTION}", E.EmbeddingRequest,
     E.EmbeddingResponse, (400, 401, 404, 413, 415, 503)),
    ("post", "/api/chat", "Ollama's chat" + OLLAMA_STREAM, O.OllamaChatRequest, O.OllamaChatChunk,
     (400, 401, 404, 413, 500, 503)),
    ("post", "/api/generate", "Ollama's generate: the prompt as a user turn, or as it is with raw=true"
     + OLLAMA_STREAM, O.OllamaGenerateRequest, O.OllamaGenerateChunk, (400, 401, 404, 413, 500, 503)),
    ("post", "/api/embed", f"Ollama's embeddings. {E.POOLING_DESCRIPTION}", O.OllamaEmbedRequest,
     O.OllamaEmbedResponse, (400, 401, 404, 413, 503)),
    ("post", "/api/embeddings", "Ollama's older embeddings route: one prompt, not normalised",
     O.OllamaEmbeddingsRequest, O.OllamaEmbeddingsResponse, (400, 401, 404, 413, 503)),
    ("get", "/api/tags", "Ollama's list of the served models", None, O.OllamaTags, (401, 503)),
    ("get", "/api/ps", "Ollama's list of the loaded models", None, O.OllamaProcesses, (401, 503)),
    ("post", "/api/show", "Ollama's description of a served model", O.OllamaShowRequest, O.OllamaShowResponse,
     (400, 401, 404, 503)),
    ("get", "/api/version", "The Ollama release whose API the /api/ routes follow", None, O.OllamaVersion, (401,)),
    ("post", "/api/pull", "Succeeds for a served model; nothing is downloaded", O.OllamaPullRequest,
     O.OllamaStatus, (400, 401, 404, 503)),
    ("post", "/api/create", "Not supported: no model store", None, O.OllamaError, (401, 404)),
    ("post", "/api/copy", "Not supported: no model store", None, O.OllamaError, (401, 404)),
    ("post", "/api/push", "Not supported: no model store", None, O.OllamaError, (401, 404)),
    ("delete", "/api/delete", "Not supported: no model store", None, O.OllamaError, (401, 404)),
    ("post", "/completion", "llama-server's native completion" + LLAMACPP_STREAM, LC.LlamaCppCompletionRequest,
     LC.LlamaCppResults, (400, 401, 404, 413, 500, 503)),
    ("post", "/completions", "The same as /completion (llama-server's other name of it)",
     LC.LlamaCppCompletionRequest, LC.LlamaCppResults, (400, 401, 404, 413, 500, 503)),
    ("post", "/apply-template", "llama-server's: the chat template applied to messages, nothing generated",
     LC.ApplyTemplateRequest, LC.ApplyTemplateResponse, (400, 401, 404, 413, 503)),
    ("get", "/props", "llama-server's description of the server: default settings, slots, model, template",
     None, LC.LlamaCppProps, (401, 503)),
    ("get", "/v1/models", "The served models", None, A.ModelList, (401,)),
    ("get", "/v1/models/{model}", "One served model", None, A.ModelCard, (401, 404)),
    ("get", "/health", "200 when the engine is ready", None, A.HealthResponse, (503,)),
    ("get", "/metrics", "Prometheus metrics: ember:* series, and vllm:* series named and labelled as vLLM's "
     "(for its dashboards)", None, TEXT, ()),
    ("get", "/version", "Server version and runtime", None, dict, ()),
    ("post", "/tokenize", "Text or chat messages to token ids (vLLM's forms; `content`: llama-server's)", Q.TokenizeRequest, A.TokenizeResponse,
     (400, 401, 404, 503)),
    ("post", "/detokenize", "Token ids to text", Q.DetokenizeRequest, A.DetokenizeResponse, (400, 401, 404, 503)),
    ("get", "/tokenizer_info", "The tokenizer's special tokens and chat template", None, A.TokenizerInfoResponse,
     (401, 503)),
    ("get", "/openapi.json", "This document", None, dict, ()),
    ("get", "/", "The chat page: a browser UI that streams /v1/chat/completions", None, HTML, ()),
    ("get", "/docs", "This document as a browsable API reference", None, HTML, ()),
]
STREAMED = {A.Completion: A.Completion, A.ChatCompletion: A.ChatCompletionChunk}
# what each {name} of a route's path is
PATH_PARAMETERS = {"model": "One of the served model names (GET /v1/models lists them)",
                   "response_id": "The id of a response created with store=true (resp_...)"}


class _NoTitles(GenerateJsonSchema):
    """Leaves out the "title" pydantic derives from every field name: noise in a spec."""

    def field_title_should_be_set(self, schema) -> bool:
        return False


def _models() -> list[type[BaseModel]]:
    found = {A.ErrorResponse, A.ChatCompletionChunk, AN.AnthropicErrorResponse, O.OllamaError}
    for *_, request, response, _ in ROUTES:
        found.update(m for m in (request, response) if isinstance(m, type) and issubclass(m, BaseModel))
    return sorted(found, key=lambda m: m.__name__)


@functools.lru_cache(maxsize=1)
def component_schemas() -> dict:
    models = _models()
    inputs = [(m, "validation") for m in models if issubclass(m, Q.ProtocolModel)]
    outputs = [(m, "serialization") for m in models if not issubclass(m, Q.ProtocolModel)]
    _, schema = models_json_schema(inputs + outputs, ref_template=REF, schema_generator=_NoTitles)
    return schema["$defs"]


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def _ref(model) -> dict:
    return {"$ref": REF.format(model=model.__name__)} if model is not dict else {"type": "object"}


def _operation(path: str, summary: str, request, response, errors) -> dict:
    ok = {"description": "OK"}
    if isinstance(response, str):
        ok["content"] = {response: {"schema": {"type": "string"}}}
    elif response in STREAMED:
        ok["description"] = ("The result, or with stream=true a text/event-stream of "
                             f"{STREAMED[response].__name__} chunks ending with `data: [DONE]`")
        ok.update(_json(_ref(response)))
    else:
        ok.update(_json(_ref(response)))
    error, described = ((AN.AnthropicErrorResponse, ANTHROPIC_ERRORS) if speaks_anthropic(path)
                        else (O.OllamaError, OLLAMA_ERRORS) if speaks_ollama(path) else (A.ErrorResponse, ERRORS))
    operation = {"summary": summary, "responses": {
        "200": ok, **{str(s): {"description": described[s], **_json(_ref(error))} for s in errors}}}
    if path.startswith(PROTECTED_PREFIXES):   # a key when the server runs with --api-key
        operation["security"] = [{"bearer": []}, {"apiKey": []}, {}]
    if request is not None:
        operation["requestBody"] = {"required": True, **_json(_ref(request))}
    parameters = [{"name": name, "in": "path", "required": True, "description": PATH_PARAMETERS[name],
                   "schema": {"type": "string"}} for name in re.findall(r"\{(\w+)\}", path)]
    if parameters:
        operation["parameters"] = parameters
    return operation


def openapi_spec(version: str) -> dict:
    paths: dict = {}
    for method, path, summary, request, response, errors in ROUTES:
        paths.setdefault(path, {})[method] = _operation(path, summary, request, response, errors)
    return {
        "openapi": "3.1.0",
        "info": {"title": "ember-cupy", "version": version,
                 "description": "OpenAI-compatible LLM inference server"},
        "components": {"schemas": component_schemas(),
                       "securitySchemes": {"bearer": {
                           "type": "http", "scheme": "bearer",
                           "description": "Required by the operations that list it when the server runs "
                                          "with --api-key; the others are always public."},
                           "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                                      "description": "The same key as Anthropic's clients send it."}}},
        "paths": paths,
    }
