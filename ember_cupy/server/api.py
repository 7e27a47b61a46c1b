"""The aiohttp application: OpenAI-compatible routes, Anthropic's /v1/messages, Ollama's /api/,
llama-server's /completion, health, metrics, tokenizer and docs."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

from aiohttp import web

import ember_cupy
from ember_cupy import tool_calls
from ember_cupy.sampling_params import MAX_LOGPROBS
from ember_cupy.server.access_log import access_log_middleware
from ember_cupy.server.async_engine import AsyncEngine, EngineOverloadedError, EngineState, PrepareTimeoutError
from ember_cupy.server.embeddings import EmbeddingsServing
from ember_cupy.server.errors import APIError, bad_request
from ember_cupy.server.metrics import CONTENT_TYPE_LATEST
from ember_cupy.server.middleware import auth_middleware, cors_handlers, error_middleware
from ember_cupy.server.protocol import validate
from ember_cupy.server.protocol.constraints import tool_spec
from ember_cupy.server.protocol.requests import DetokenizeRequest, TokenizeRequest
from ember_cupy.server.output_parsers import OutputParsers
from ember_cupy.server.response_store import MAX_BYTES, ResponseStore
from ember_cupy.server.serving import (
    DEFAULT_MAX_PROMPT_TOKENS_PER_REQUEST,
    OpenAIServing,
    engine_error,
    text_chars,
)
from ember_cupy.server.static_pages import add_static_pages
from ember_cupy.server.validation import READ_TIMEOUT_KEY, read_json_body

log = logging.getLogger("ember_cupy.server")

ENGINE_KEY = web.AppKey("engine", AsyncEngine)
SERVING_KEY = web.AppKey("serving", OpenAIServing)
SETTINGS_KEY = web.AppKey("settings", object)
START_TASK_KEY = web.AppKey("engine_start_task", asyncio.Task)


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=lambda: ["SmolLM2-135M-Instruct"])
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)    # CORS off when empty
    max_body_bytes: int = 4 << 20
    drain_timeout: float = 10.0      # graceful shutdown: seconds in-flight requests may finish in
    # seconds a client may take to send a request's headers (counted from the connection's start
    # or its previous response: also the idle keep-alive timeout), and again its body
    read_timeout: float = 30.0
    model_path: str | None = None
    response_store_bytes: int = MAX_BYTES   # the Responses API's stored responses, as JSON bytes
    max_prompt_tokens_per_request: int = DEFAULT_MAX_PROMPT_TOKENS_PER_REQUEST
    reasoning_parser: str | None = None   # deepseek_r1 | qwen3 (ember_cupy/reasoning.py)
    tool_call_parser: str | None = None   # a family's call format for tool_choice auto (tool_parsers.py)
    max_logprobs: int = MAX_LOGPROBS      # vLLM's --max-logprobs: most top logprobs a request may ask


def base_app(settings: ServerSettings) -> web.Application:
    """An application with the server's middlewares (access log, CORS, errors, auth) and limits."""
    middlewares = [error_middleware()]
    preflight = on_prepare = None
    if settings.allowed_origins:
        preflight, on_prepare = cors_handlers(settings.allowed_origins)
        middlewares.insert(0, preflight)
    middlewares.insert(0, access_log_middleware())   # outermost: sees every final status
    if settings.api_key:
        middlewares.append(auth_middleware(settings.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    if on_prepare is not None:
        app.on_response_prepare.append(on_prepare)
    app[SETTINGS_KEY] = settings
    app[READ_TIMEOUT_KEY] = settings.read_timeout
    return app


class _BuiltAtFirstRequest:
    """Handlers of an object built when one of them is first called. The Responses and Messages
    APIs' modules and pydantic models take ~15-20 ms each to import: a server that is never asked
    for them should not wait for them at every start."""

    def __init__(self, build):
        self._build, self._built = build, None

    def handler(self, name: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            if self._built is None:
                self._built = self._build()
            return await getattr(self._built, name)(request)
        return handle


def _responses_serving(serving, settings: ServerSettings):
    from ember_cupy.server.responses_api import ResponsesServing
    return ResponsesServing(serving, ResponseStore(max_bytes=settings.response_store_bytes))


def _messages_serving(serving):
    from ember_cupy.server.messages_api import MessagesServing
    return MessagesServing(serving)


def _ollama_serving(serving):
    from ember_cupy.server.ollama_api import OllamaServing
    return OllamaServing(serving)


def _llamacpp_serving(serving):
    from ember_cupy.server.llamacpp_api import LlamaCppServing
    return LlamaCppServing(serving)


# llama-server's native API: route -> (method, LlamaCppServing's handler); /tokenize and
# /detokenize take its forms too
LLAMACPP_ROUTES = {"/completion": ("post", "completion"), "/completions": ("post", "completion"),
                   "/apply-template": ("post", "apply_template"), "/props": ("get", "props")}
# Ollama's native API: route -> (method, OllamaServing's handler)
OLLAMA_ROUTES = {"/api/chat": ("post", "chat"), "/api/generate": ("post", "generate"),
                 "/api/embed": ("post", "embed"), "/api/embeddings": ("post", "embeddings"),
                 "/api/tags": ("get", "tags"), "/api/ps": ("get", "ps"), "/api/show": ("post", "show"),
                 "/api/version": ("get", "version"), "/api/pull": ("post", "pull"),
                 "/api/create": ("post", "not_supported"), "/api/copy": ("post", "not_supported"),
                 "/api/push": ("post", "not_supported"), "/api/delete": ("delete", "not_supported")}


def build_app(engine: AsyncEngine, settings: ServerSettings) -> web.Application:
    app = base_app(settings)
    serving = OpenAIServing(engine, settings.served_model_names, settings.max_prompt_tokens_per_request,
                            OutputParsers.named(settings.reasoning_parser, settings.tool_call_parser),
                            max_logprobs=settings.max_logprobs)
    app[ENGINE_KEY] = engine
    app[SERVING_KEY] = serving
    handlers = _Handlers(engine, serving, settings)
    app.router.add_post("/v1/completions", serving.completions)
    app.router.add_post("/v1/chat/completions", serving.chat)
    responses = _BuiltAtFirstRequest(lambda: _responses_serving(serving, settings))
    app.router.add_post("/v1/responses", responses.handler("create"))
    app.router.add_get("/v1/responses/{response_id}", responses.handler("retrieve"))
    app.router.add_post("/v1/embeddings", EmbeddingsServing(serving).embeddings)
    messages = _BuiltAtFirstRequest(lambda: _messages_serving(serving))
    app.router.add_post("/v1/messages", messages.handler("create"))
    app.router.add_post("/v1/messages/count_tokens", messages.handler("count_tokens"))
    ollama = _BuiltAtFirstRequest(lambda: _ollama_serving(serving))
    for path, (method, name) in OLLAMA_ROUTES.items():
        app.router.add_route(method.upper(), path, ollama.handler(name))
    llamacpp = _BuiltAtFirstRequest(lambda: _llamacpp_serving(serving))
    for path, (method, name) in LLAMACPP_ROUTES.items():
        app.router.add_route(method.upper(), path, llamacpp.handler(name))
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/v1/models/{model}", handlers.model)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/version", handlers.version)
    app.router.add_post("/tokenize", handlers.tokenize)
    app.router.add_post("/detokenize", handlers.detokenize)
    app.router.add_get("/tokenizer_info", handlers.tokenizer_info)
    app.router.add_get("/openapi.json", handlers.openapi)
    add_static_pages(app.router)   # / (chat page) and /docs
    app.on_startup.append(_start_engine)
    app.on_cleanup.append(_stop_engine)
    return app


async def _start_engine(app: web.Application) -> None:
    engine = app[ENGINE_KEY]
    if engine.state is EngineState.NEW:  # load in the background: /health says 503 meanwhile
        task = asyncio.get_running_loop().create_task(engine.start())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # reported on /health
        app[START_TASK_KEY] = task


async def wait_engine_started(app: web.Application) -> None:
    """Until the engine build_app started in the background is loaded (or failed to load)."""
    task = app.get(START_TASK_KEY)
    if task is not None:
        await asyncio.shield(task)


async def _stop_engine(app: web.Application) -> None:
    await app[ENGINE_KEY].shutdown(drain_timeout=0)


# Ids per json.dumps call for a long /tokenize answer: one call over 1.5M ids (a 4 MB text) holds
# the GIL 0.12 s, stalling the event loop and the engine; a slice holds it about a millisecond.
TOKENS_JSON_SLICE = 2048


def _json_list_in_slices(values: list) -> str:
    slices = (json.dumps(values[i:i + TOKENS_JSON_SLICE])[1:-1]
              for i in range(0, len(values), TOKENS_JSON_SLICE))
    return "[" + ", ".join(s for s in slices if s) + "]"


def _tokenize_answer(tokenizer, text: str, add_special_tokens: bool, max_model_len: int,
                     with_token_strs: bool) -> bytes:
    """/tokenize's JSON answer for `text` (a worker thread's job, slices as above)."""
    tokens = tokenizer.encode(text, add_special_tokens)
    parts = [f'{{"count": {len(tokens)}, "max_model_len": {max_model_len}, "tokens": ', _json_list_in_slices(tokens)]
    if with_token_strs:
        parts += [', "token_strs": ', _json_list_in_slices([tokenizer.id_to_token(t) for t in tokens])]
    return ("".join(parts) + "}").encode()


def _tokenize_content_answer(tokenizer, text: str, add_special: bool, max_model_len: int, with_pieces: bool) -> bytes:
    if not with_pieces:
        return _tokenize_answer(tokenizer, text, add_special, max_model_len, False)
    tokens = tokenizer.encode(text, add_special)
    pieces = []
    for token_id, raw in zip(tokens, tokenizer.tokens_bytes(tokens)):
        try:
            piece = raw.decode("utf-8")
        except UnicodeDecodeError:   # part of a character: its bytes, as llama-server gives them
            piece = list(raw)
        pieces.append({"id": token_id, "piece": piece})
    return json.dumps({"count": len(tokens), "max_model_len": max_model_len, "tokens": pieces},
                      ensure_ascii=False).encode()


class _Handlers:
    def __init__(self, engine: AsyncEngine, serving: OpenAIServing, settings: ServerSettings):
        self.engine = engine
        self.serving = serving
        self.settings = settings
        self.created = int(time.time())

    def _model_card(self, name: str) -> dict:
        card = {"id": name, "object": "model", "created": self.created, "owned_by": "ember-cupy",
                "root": self.settings.model_path or name, "parent": None}
        if self.engine.is_ready:
            card["max_model_len"] = self.engine.max_model_len
        return card

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [self._model_card(n) for n in self.settings.served_model_names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        self.serving.check_model(name)
        return web.json_response(self._model_card(name))

    async def health(self, request: web.Request) -> web.Response:
        state = self.engine.state
        if state is EngineState.READY:
            return web.json_response({"status": "ready"})
        if state is EngineState.DEAD:
            error = APIError(503, f"the engine is dead: {self.engine.error}", code="engine_dead")
        else:
            error = APIError(503, f"the engine is {state.value}", code=f"engine_{state.value}")
        body = error.body()
        body["status"] = state.value
        return web.json_response(body, status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        metrics = self.engine.metrics
        payload = metrics.render() if metrics is not None else b""
        return web.Response(body=payload, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def version(self, request: web.Request) -> web.Response:
        if self.engine.is_ready:
            return web.json_response(self.engine.model_info().runtime)
        from ember_cupy.info import runtime_info
        return web.json_response(runtime_info())

    async def openapi(self, request: web.Request) -> web.Response:
        from ember_cupy.server.openapi import openapi_spec   # every protocol model: imported when asked
        return web.json_response(openapi_spec(ember_cupy.__version__))

    async def tokenize(self, request: web.Request) -> web.Response:
        # any Content-Type, as llama-server reads it (from a browser only JSON: read_json_body)
        body = validate(TokenizeRequest, await read_json_body(request, any_content_type=True))
        self.serving.ensure_ready()
        self.serving.check_model(body.model)
        tokenizer = self.engine.tokenizer
        given = [name for name in ("prompt", "messages", "content") if getattr(body, name) is not None]
        if len(given) != 1:
            raise bad_request("give exactly one of 'prompt', 'messages' and 'content'", param="prompt",
                              code="missing_required_parameter")
        field = given[0]
        if field == "content":
            return await self._tokenize_content(body)
        try:
            if body.prompt is not None:
                text = body.prompt
            else:
                messages = [m.template_dict() for m in body.messages]
                text = await self.engine.off_loop(tool_calls.render_chat, tokenizer, messages, tool_spec(body),
                                                  add_generation_prompt=body.add_generation_prompt,
                                                  work_chars=text_chars(messages), **(body.chat_template_kwargs or {}))
            add_special_tokens = body.prompt is not None if body.add_special_tokens is None else body.add_special_tokens
            # the ids are made, written and freed on a worker thread: a 4 MB text's 1.5M of them
            # cost the event loop 0.12 s to serialize and ~50 ms to free
            json_body = await self.engine.off_loop(_tokenize_answer, tokenizer, text, add_special_tokens,
                                                   self.engine.max_model_len, body.return_token_strs,
                                                   work_chars=len(text))
        except (ValueError, TypeError) as exc:   # a template's own error, as chat answers it
            raise bad_request(str(exc), param=field) from None
        except (EngineOverloadedError, PrepareTimeoutError) as exc:
            raise engine_error(exc) from None
        return web.Response(body=json_body, content_type="application/json", charset="utf-8")

    async def _tokenize_content(self, body: TokenizeRequest) -> web.Response:
        """llama-server's /tokenize: {"tokens": ids, or {id, piece} objects with with_pieces}."""
        try:
            json_body = await self.engine.off_loop(_tokenize_content_answer, self.engine.tokenizer, body.content,
                                                   body.add_special, self.engine.max_model_len, body.with_pieces,
                                                   work_chars=len(body.content))
        except ValueError as exc:
            raise bad_request(str(exc), param="content") from None
        except (EngineOverloadedError, PrepareTimeoutError) as exc:
            raise engine_error(exc) from None
        return web.Response(body=json_body, content_type="application/json", charset="utf-8")

    async def detokenize(self, request: web.Request) -> web.Response:
        raw = await read_json_body(request, any_content_type=True)
        self.serving.ensure_ready()
        body = validate(DetokenizeRequest, raw, self.engine.tokenizer.vocab_size)
        self.serving.check_model(body.model)
        text = self.engine.tokenizer.decode(body.tokens)
        return web.json_response({"prompt": text, "content": text})   # vLLM's name, llama-server's

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        self.serving.ensure_ready()
        tokenizer = self.engine.tokenizer
        token = lambda i: None if i is None else tokenizer.id_to_token(i)  # noqa: E731
        eos = list(tokenizer.eos_token_ids)
        template = tokenizer.chat_template
        return web.json_response({
            "tokenizer_class": "PreTrainedTokenizerFast", "vocab_size": tokenizer.vocab_size,
            "model_max_length": self.engine.max_model_len, "bos_token": token(tokenizer.bos_token_id),
            "eos_token": token(eos[0] if eos else None), "eos_token_ids": eos, "pad_token": None,
            "add_bos_token": bool(tokenizer.add_bos_token),
            "chat_template": template.source if template is not None else None})
