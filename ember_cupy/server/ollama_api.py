"""Ollama's native API, for the clients and tools made for Ollama (its Python and JS libraries,
Open WebUI, Continue, langchain-ollama...): point them at this server's address.

/api/chat and /api/generate run on the chat and completion paths (ollama_requests.py maps the
request; ollama_replies.py writes the reply, newline-delimited JSON by default); /api/embed and
/api/embeddings on the embeddings path; /api/tags, /api/ps and /api/show describe the served
model (ollama_models.py); /api/version names the Ollama release whose API this follows. /api/pull
of a served model succeeds at once; nothing is ever downloaded, and the routes that manage
Ollama's model store (create, copy, delete, push) answer 404 saying so. Errors leave in Ollama's shape
(ollama_errors.py, applied by the error middleware).
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid

from aiohttp import web

from ember_cupy import tool_calls
from ember_cupy.engine.pooling import PoolingParams
from ember_cupy.server import ollama_models as models
from ember_cupy.server import ollama_requests as Q
from ember_cupy.server.async_engine import EngineDeadError, EngineNotReadyError
from ember_cupy.server.embeddings import EmbeddingsServing
from ember_cupy.server.errors import CONSTRAINT_FAILED, APIError
from ember_cupy.server.ollama_replies import NDJSON, OllamaReply, line, loaded
from ember_cupy.server.protocol import parse_completion, validate
from ember_cupy.server.protocol.ollama import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaPullRequest,
    OllamaShowRequest,
)
from ember_cupy.server.request_stream import RequestStream
from ember_cupy.server.serving import OpenAIServing, engine_error
from ember_cupy.server.validation import read_json_body
from ember_cupy.server.whole_reply import fed_whole

log = logging.getLogger("ember_cupy.server")
OLLAMA_API_VERSION = "0.12.6"   # the Ollama release whose API these routes follow


async def _body(request: web.Request) -> dict:
    return await read_json_body(request, any_content_type=True)


class OllamaServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.engine = serving.engine
        self.embedding = EmbeddingsServing(serving)
        self._served_file: models.ServedFile | None = None

    # --- generation -------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = validate(OllamaChatRequest, await _body(request))
        name = self._served(req.model)
        if not req.messages:
            return web.json_response(loaded("chat", req.model))
        body = {**Q.chat_body(req, Q.chat_messages(req), self._splits_reasoning()), "model": name}
        gen, prompt, tools = await self.serving.prepare_chat(body)
        token_ids = (await self.serving.tokenize_prompts([prompt], "messages", add_special_tokens=False,
                                                         params=gen.params))[0]
        reply = self._reply("chat", req, prompt, tools)
        return await self._run(request, req.stream, reply, prompt, gen.params, token_ids)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        self.serving.ensure_ready()
        req = validate(OllamaGenerateRequest, body, self.engine.tokenizer.vocab_size)
        name = self._served(req.model)
        if not req.prompt and not req.context:
            return web.json_response(loaded("generate", req.model))
        if req.raw:
            ids = (await self.serving.tokenize_prompts([req.prompt], "prompt",
                                                       add_special_tokens=not req.context))[0]
            token_ids = (req.context or []) + ids
            body = {**Q.raw_completion_body(req, token_ids, self.engine.max_model_len, self._splits_reasoning()),
                    "model": name}
            gen = parse_completion(body, self.engine.tokenizer.vocab_size)
            self.serving.check_request(gen)
            gen.params = dataclasses.replace(gen.params, structured_outputs=gen.constraint)
            prompt, tools = req.prompt, tool_calls.NO_TOOLS
        else:
            body = {**Q.chat_body(req, Q.generate_messages(req), self._splits_reasoning()), "model": name}
            gen, prompt, tools = await self.serving.prepare_chat(body)
            ids = (await self.serving.tokenize_prompts([prompt], "prompt", add_special_tokens=False,
                                                       params=gen.params))[0]
            token_ids = (req.context or []) + ids
        reply = self._reply("generate", req, prompt, tools)
        return await self._run(request, req.stream, reply, prompt, gen.params, token_ids)

    def _served(self, name: str) -> str:
        self.serving.ensure_ready()
        served = Q.served_name(name, self.serving.model_names)
        if served is None:
            raise APIError(404, f"model '{name}' not found; this server serves {self.serving.model_names} and "
                                "downloads nothing", param="model", code="model_not_found")
        return served

    def _splits_reasoning(self) -> bool:
        return self.serving.output_parsers.reasoning is not None

    def _reply(self, kind: str, req, prompt: str, tools: tool_calls.ToolSpec) -> OllamaReply:
        return OllamaReply(kind, req.model, prompt, self.serving.output_parsers, tools,
                           tool_calls.template_supports_tools(self.engine.tokenizer), self.engine.tokenizer,
                           bool(req.logprobs))

    async def _run(self, request: web.Request, streamed: bool, reply: OllamaReply, prompt: str, params,
                   token_ids: list[int]) -> web.StreamResponse:
        room = max(self.engine.max_model_len - len(token_ids), 1)
        if params.max_tokens is not None and params.max_tokens > room:   # Ollama stops where the context ends
            params = dataclasses.replace(params, max_tokens=room)
        try:
            stream = await self.engine.add_request(prompt, params, request_id=f"ollama-{uuid.uuid4().hex}",
                                                   prompt_token_ids=token_ids)
        except Exception as exc:   # noqa: BLE001 - every admission failure has an HTTP error
            raise engine_error(exc) from None
        try:
            if streamed:
                return await self._stream(request, stream, reply)
            return web.json_response(await self._whole(stream, reply))
        finally:
            stream.close()

    async def _whole(self, stream: RequestStream, reply: OllamaReply) -> dict:
        return reply.whole(await fed_whole(stream, reply))

    async def _stream(self, request: web.Request, stream: RequestStream, reply: OllamaReply) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        try:
            async for output in stream:
                for body in reply.feed(output):
                    await response.write(line(body))
                if reply.failed:
                    await response.write(line({"error": CONSTRAINT_FAILED}))
                    break
            await response.write_eof()
        except ConnectionError:   # the client went away: _run closes the stream, which aborts it
            log.debug("client disconnected from an Ollama reply")
        except (EngineDeadError, EngineNotReadyError) as exc:
            try:
                await response.write(line({"error": engine_error(exc).message}))
            except ConnectionError:
                pass
        return response

    # --- embeddings -------------------------------------------------------------------------
    async def embed(self, request: web.Request) -> web.Response:
        started = time.monotonic()
        req = validate(OllamaEmbedRequest, await _body(request))
        self._served(req.model)
        self.embedding.check_dimensions(req.dimensions)
        inputs = [req.input] if isinstance(req.input, str) else req.input
        if inputs == [""]:
            inputs = []
        # truncate=true keeps as many of an input's first tokens as the context holds
        params = PoolingParams(truncate_prompt_tokens=-1 if req.truncate else None)
        finals = await self.embedding.pooled(inputs, params) if inputs else []
        return web.json_response({
            "model": req.model, "embeddings": [final.embedding for final in finals],
            "total_duration": int((time.monotonic() - started) * 1e9), "load_duration": 0,
            "prompt_eval_count": sum(len(final.prompt_token_ids) for final in finals)})

    async def embeddings(self, request: web.Request) -> web.Response:
        """Ollama's older route: one prompt, its embedding not normalised (as Ollama's)."""
        req = validate(OllamaEmbeddingsRequest, await _body(request))
        self._served(req.model)
        if not req.prompt:
            return web.json_response({"embedding": []})
        finals = await self.embedding.pooled([req.prompt], PoolingParams(normalize=False))
        return web.json_response({"embedding": finals[0].embedding})

    # --- the served model -------------------------------------------------------------------
    def _file(self) -> models.ServedFile:
        if self._served_file is None:
            self._served_file = models.ServedFile(self.engine.model_info().source)
        return self._served_file

    async def tags(self, request: web.Request) -> web.Response:
        self.serving.ensure_ready()
        info, served = self.engine.model_info(), self._file()
        return web.json_response({"models": [models.tags_entry(name, info.source, info, served)
                                             for name in self.serving.model_names]})

    async def ps(self, request: web.Request) -> web.Response:
        self.serving.ensure_ready()
        info, served = self.engine.model_info(), self._file()
        return web.json_response({"models": [models.running_entry(name, info, served)
                                             for name in self.serving.model_names]})

    async def show(self, request: web.Request) -> web.Response:
        req = validate(OllamaShowRequest, await _body(request))
        self._served(req.model or req.name)
        tokenizer = self.engine.tokenizer
        template = tokenizer.chat_template.source if tokenizer.chat_template is not None else ""
        capabilities = ["completion", "embedding"]
        if tool_calls.template_supports_tools(tokenizer):
            capabilities.append("tools")
        if self._splits_reasoning():
            capabilities.append("thinking")
        return web.json_response(models.show_body(self.engine.model_info(), self._file(), template, capabilities))

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": OLLAMA_API_VERSION})

    async def pull(self, request: web.Request) -> web.Response:
        """A served model is there already: Ollama's answer for a model it has (nothing is downloaded)."""
        req = validate(OllamaPullRequest, await _body(request))
        self._served(req.model or req.name)
        if not req.stream:
            return web.json_response({"status": "success"})
        return web.Response(body=line({"status": "success"}), content_type=NDJSON)

    async def not_supported(self, request: web.Request) -> web.Response:
        raise APIError(404, f"{request.path} is not supported: ember-cupy serves the models it was started with "
                            "(--model) and keeps no model store", code="not_supported")
