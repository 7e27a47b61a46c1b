"""llama.cpp's native server API, for the tools made for llama-server (its `/completion` clients,
editor plugins, front ends): /completion (and /completions) runs on the completion path
(llamacpp_requests.py maps the request; llamacpp_replies.py writes the result, server-sent events
when streamed); /apply-template renders the chat template; /props describes the server. /tokenize
and /detokenize answer llama-server's forms too (api.py). Errors keep the OpenAI shape, which
llama-server's resembles ({"error": {"code", "message", "type"}}).
"""
from __future__ import annotations

import dataclasses
import logging
import uuid

from aiohttp import web

import ember_cupy
from ember_cupy import tool_calls
from ember_cupy.server import llamacpp_requests as Q
from ember_cupy.server.async_engine import EngineDeadError, EngineNotReadyError
from ember_cupy.server.completion_bodies import sse
from ember_cupy.server.errors import bad_request, constraint_failed
from ember_cupy.server.llamacpp_replies import LlamaCppReply
from ember_cupy.server.protocol import parse_completion, validate
from ember_cupy.server.protocol.llamacpp import ApplyTemplateRequest, LlamaCppCompletionRequest
from ember_cupy.server.request_stream import RequestStream
from ember_cupy.server.serving import OpenAIServing, engine_error
from ember_cupy.server.validation import read_json_body
from ember_cupy.server.whole_reply import fed_whole

log = logging.getLogger("ember_cupy.server")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclasses.dataclass
class _Prompt:
    """One prompt of a request, ready to run: its text (as the result reports it), ids and params."""
    text: str
    token_ids: list[int]
    params: object
    reply: LlamaCppReply


class LlamaCppServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.engine = serving.engine

    # --- /completion ------------------------------------------------------------------------
    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await read_json_body(request, any_content_type=True)
        self.serving.ensure_ready()
        req = validate(LlamaCppCompletionRequest, body, self.engine.tokenizer.vocab_size)
        self.serving.check_model(req.model)
        req = Q.with_server_defaults(req, self.engine.model_info().sampling_defaults)
        if req.stream and len(req.prompt) > 1:
            raise bad_request("a streamed completion takes one prompt; send a request per prompt", param="prompt")
        model = req.model or self.serving.model_names[0]
        bias = Q.logit_bias(req.logit_bias or [], await self._bias_text_ids(req.logit_bias or []))
        prompts = [await self._prepare(index, pieces, req, model, bias) for index, pieces in enumerate(req.prompt)]
        self.serving.check_prompt_total([prompt.token_ids for prompt in prompts], "prompt")
        streams: list[RequestStream | None] = []
        try:
            for prompt in prompts:
                streams.append(await self._admit(prompt, req))
            if req.stream:
                return await self._stream(request, streams[0], prompts[0].reply)
            results = [await self._whole(stream, prompt.reply) for stream, prompt in zip(streams, prompts)]
        finally:
            for stream in streams:
                if stream is not None:
                    stream.close()
        return web.json_response(results[0] if len(results) == 1 else results)

    async def _token_ids(self, pieces: list) -> list[int]:
        """The prompt's ids: its texts tokenized (BOS, where the model adds one, only before a
        leading text), its ids as they are."""
        ids: list[int] = []
        for position, piece in enumerate(pieces):
            if isinstance(piece, str):
                ids += (await self.serving.tokenize_prompts([piece], "prompt", add_special_tokens=position == 0))[0]
            else:
                ids.append(piece)
        return ids

    async def _bias_text_ids(self, pairs) -> dict[str, list[int]]:
        texts = {key for key, _ in pairs if isinstance(key, str)}
        return {text: (await self.serving.tokenize_prompts([text], "logit_bias", add_special_tokens=False))[0]
                for text in texts}

    async def _prepare(self, index: int, pieces: list, req: LlamaCppCompletionRequest, model: str,
                       bias: dict[str, float]) -> _Prompt:
        token_ids = await self._token_ids(pieces)
        body = {**Q.completion_body(req, token_ids, self.engine.max_model_len, bias), "model": model}
        gen = parse_completion(body, self.engine.tokenizer.vocab_size)
        self.serving.check_request(gen)
        params = dataclasses.replace(gen.params, structured_outputs=gen.constraint)
        whole_text = len(pieces) == 1 and isinstance(pieces[0], str)
        text = pieces[0] if whole_text else self.engine.tokenizer.decode(token_ids, skip_special_tokens=False)
        settings = Q.generation_settings(req, body, self.engine.max_model_len, model)
        reply = LlamaCppReply(index, model, text, settings, self.engine.tokenizer, n_probs=req.n_probs,
                              return_tokens=req.return_tokens, timings_per_token=req.timings_per_token,
                              response_fields=req.response_fields)
        return _Prompt(text, token_ids, params, reply)

    async def _admit(self, prompt: _Prompt, req: LlamaCppCompletionRequest) -> RequestStream | None:
        """The prompt's stream; None for n_predict 0, which asks for nothing (the result says so
        at once; unlike llama-server, nothing is computed)."""
        if req.n_predict == 0:
            prompt.reply.nothing_asked(prompt.token_ids)
            return None
        try:
            return await self.engine.add_request(prompt.text, prompt.params, request_id=f"llamacpp-{uuid.uuid4().hex}",
                                                 prompt_token_ids=prompt.token_ids)
        except Exception as exc:   # noqa: BLE001 - every admission failure has an HTTP error
            raise engine_error(exc) from None

    async def _whole(self, stream: RequestStream | None, reply: LlamaCppReply) -> dict:
        if stream is not None:
            await fed_whole(stream, reply)
        return reply.whole()

    async def _stream(self, request: web.Request, stream: RequestStream | None,
                      reply: LlamaCppReply) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            if stream is None:
                await response.write(sse(reply.whole()))
            else:
                async for output in stream:
                    for event in reply.feed(output):
                        await response.write(sse(event))
                    if reply.failed:
                        await response.write(sse(constraint_failed().body()))
                        break
            await response.write_eof()
        except ConnectionError:   # the client went away: completion() closes the stream, which aborts it
            log.debug("client disconnected from a llama.cpp completion stream")
        except (EngineDeadError, EngineNotReadyError) as exc:
            try:
                await response.write(sse(engine_error(exc).body()))
            except ConnectionError:
                pass
        return response

    # --- the chat template and the server ---------------------------------------------------
    async def apply_template(self, request: web.Request) -> web.Response:
        body = await read_json_body(request, any_content_type=True)
        req = validate(ApplyTemplateRequest, body)
        self.serving.ensure_ready()
        self.serving.check_model(req.model)
        _, prompt, _ = await self.serving.prepare_chat({"model": req.model or self.serving.model_names[0],
                                                        "messages": body["messages"], "max_tokens": 1})
        return web.json_response({"prompt": prompt})

    async def props(self, request: web.Request) -> web.Response:
        self.serving.ensure_ready()
        info, tokenizer = self.engine.model_info(), self.engine.tokenizer
        defaults = Q.with_server_defaults(validate(LlamaCppCompletionRequest, {"prompt": " "}), info.sampling_defaults)
        body = Q.completion_body(defaults, [], info.max_model_len, {})
        token = lambda i: "" if i is None else tokenizer.id_to_token(i)  # noqa: E731
        eos = list(tokenizer.eos_token_ids)
        template = tokenizer.chat_template
        return web.json_response({
            "default_generation_settings": {"n_ctx": info.max_model_len, "params": Q.generation_settings(
                defaults, body, info.max_model_len, self.serving.model_names[0])},
            "total_slots": info.max_num_seqs, "model_alias": self.serving.model_names[0], "model_path": info.source,
            "chat_template": template.source if template is not None else "",
            "chat_template_caps": {"supports_tools": tool_calls.template_supports_tools(tokenizer)},
            "bos_token": token(tokenizer.bos_token_id), "eos_token": token(eos[0] if eos else None),
            "modalities": {"vision": False, "audio": False}, "build_info": f"ember-cupy {ember_cupy.__version__}",
            "is_sleeping": False})
