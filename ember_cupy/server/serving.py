"""/v1/completions and /v1/chat/completions: admission, full responses and SSE streams."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

from aiohttp import web

from ember_cupy.server import responses as R
from ember_cupy.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
    EngineOverloadedError,
    RequestStream,
)
from ember_cupy.server.errors import APIError, from_value_error
from ember_cupy.server.protocol import GenerationRequest, parse_chat, parse_completion
from ember_cupy.server.validation import read_json_body

log = logging.getLogger("ember_cupy.server")
RETRY_AFTER_SECONDS = 1


def engine_error(exc: BaseException) -> APIError:
    """Map what AsyncEngine raises to an HTTP error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), code="server_overloaded",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, EngineNotReadyError):
        return APIError(503, str(exc), code="engine_not_ready", headers={"Retry-After": "5"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, ValueError):
        return from_value_error(exc)
    log.error("unexpected error while admitting a request", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


async def _merge(streams: list[RequestStream]):
    """(prompt index, output) from several streams, as they come. A stream is read again only
    once its previous output has been consumed: what a slow client has not taken stays in the
    streams (merged, and subject to their stall timeout), not in a queue here."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    reads = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for read in done:
                index = reads.pop(read)
                try:
                    output = read.result()
                except StopAsyncIteration:
                    continue
                yield index, output
                reads[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for read in reads:
            read.cancel()


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_names: list[str]):
        self.engine = engine
        self.model_names = model_names

    def ensure_ready(self) -> None:
        if not self.engine.is_ready:
            raise engine_error(EngineDeadError(f"the engine is dead: {self.engine.error}")
                               if self.engine.error else EngineNotReadyError(
                                   f"the engine is {self.engine.state.value}"))

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"the model '{name}' does not exist; served: {self.model_names}",
                           param="model", code="model_not_found")

    # --- endpoints ------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json_body(request)
        self.ensure_ready()
        req = parse_completion(body, self.engine.tokenizer.vocab_size)
        self.check_model(req.model)
        return await self._generate(request, req, req.prompts)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await read_json_body(request)
        self.ensure_ready()
        req = parse_chat(body, self.engine.tokenizer.vocab_size)
        self.check_model(req.model)
        try:
            prompt = await self.engine.off_loop(
                self.engine.tokenizer.apply_chat_template, req.messages,
                add_generation_prompt=req.add_generation_prompt, **req.chat_template_kwargs)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from None
        return await self._generate(request, req, [prompt])

    # --- generation -----------------------------------------------------------------------
    async def _admit(self, req: GenerationRequest, prompts: list, response_id: str) -> list[RequestStream]:
        admissions = [self.engine.add_request(p, req.params, request_id=f"{response_id}-{i}",
                                              priority=req.priority, cache_salt=req.cache_salt)
                      for i, p in enumerate(prompts)]
        results = await asyncio.gather(*admissions, return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if not isinstance(r, RequestStream)]
        if errors:
            for stream in streams:
                stream.close()
            if isinstance(errors[0], asyncio.CancelledError):
                raise errors[0]
            error = engine_error(errors[0])
            if len(prompts) > 1 and error.param == "prompt":
                index = results.index(errors[0])
                error.message = f"prompt[{index}]: {error.message}"
            raise error
        return streams

    async def _generate(self, request: web.Request, req: GenerationRequest, prompts: list):
        prefix = "chatcmpl-" if req.kind == "chat" else "cmpl-"
        response_id = prefix + uuid.uuid4().hex
        streams = await self._admit(req, prompts, response_id)
        try:
            ctx = _Context(self, req, response_id, prompts)
            if req.stream:
                return await self._stream(request, ctx, streams)
            return await self._full(ctx, streams)
        finally:
            for stream in streams:
                stream.close()

    async def _full(self, ctx: _Context, streams: list[RequestStream]) -> web.Response:
        try:
            finals = await asyncio.gather(*[s.final() for s in streams])
        except (EngineDeadError, EngineNotReadyError) as exc:
            raise engine_error(exc) from None
        choices, counter = [], R.UsageCounter()
        for prompt_index, output in enumerate(finals):
            counter.add(prompt_index, output)
            for c in output.outputs:
                choices.append(ctx.full_choice(prompt_index, output, c))
        choices.sort(key=lambda ch: ch["index"])
        body = R.envelope(ctx.req.kind, ctx.response_id, ctx.created, ctx.model, choices,
                          stream=False, usage_body=counter.body())
        return web.json_response(body)

    async def _stream(self, request: web.Request, ctx: _Context, streams) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await response.prepare(request)
        counter = R.UsageCounter()
        try:
            first = ctx.first_chunks(len(streams))
            if first:
                await response.write(R.sse(ctx.chunk(first, counter)))
            async for prompt_index, output in _merge(streams):
                counter.add(prompt_index, output)
                choices = ctx.stream_choices(prompt_index, output)
                if choices:
                    await response.write(R.sse(ctx.chunk(choices, counter)))
            if ctx.req.include_usage:
                await response.write(R.sse(R.envelope(ctx.req.kind, ctx.response_id, ctx.created, ctx.model,
                                                      [], stream=True, usage_body=counter.body())))
            await response.write(b"data: [DONE]\n\n")
        except ConnectionError:  # the client went away: the finally of _generate aborts
            log.debug("client disconnected from %s", ctx.response_id)
            return response
        except (EngineDeadError, EngineNotReadyError) as exc:
            try:
                await response.write(R.sse(engine_error(exc).body()))
                await response.write(b"data: [DONE]\n\n")
            except ConnectionError:
                pass
            return response
        try:
            await response.write_eof()
        except ConnectionError:
            pass
        return response


class _Context:
    """What one response needs to turn outputs into choices: ids, offsets, what was sent."""

    def __init__(self, serving: OpenAIServing, req: GenerationRequest, response_id: str, prompts: list):
        self.req = req
        self.response_id = response_id
        self.created = int(time.time())
        self.model = req.model or serving.model_names[0]
        self.tokenizer = serving.engine.tokenizer
        self.logprobs = R.LogprobFormatter(self.tokenizer)
        self.prompts = prompts
        self.n = req.params.n
        self.text_offset: dict[int, int] = {}
        self.done: set[int] = set()

    def _prompt_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def full_choice(self, prompt_index: int, output, c) -> dict:
        index = prompt_index * self.n + c.index
        if self.req.kind == "chat":
            lp = self.logprobs.chat(c.logprobs) if c.logprobs is not None else None
            return R.chat_choice(index, c, lp)
        prefix = self._prompt_text(prompt_index) if self.req.echo else ""
        lp = self.logprobs.completion(c.logprobs, len(prefix)) if c.logprobs is not None else None
        return R.completion_choice(index, c, prefix + c.text, lp)

    def first_chunks(self, num_prompts: int) -> list[dict]:
        """Chat: the assistant role for every choice; echo: the prompt text."""
        indices = range(num_prompts * self.n)
        if self.req.kind == "chat":
            return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for i in indices]
        if self.req.echo:
            chunks = []
            for i in indices:
                text = self._prompt_text(i // self.n)
                self.text_offset[i] = len(text)
                chunks.append({"index": i, "text": text, "logprobs": None, "finish_reason": None,
                               "stop_reason": None})
            return chunks
        return []

    def stream_choices(self, prompt_index: int, output) -> list[dict]:
        choices = []
        for c in output.outputs:
            index = prompt_index * self.n + c.index
            if index in self.done:
                continue
            entries = c.logprobs   # a delta output's: those of its new tokens
            if not c.delta_text and not c.finish_reason and not entries:
                continue
            if c.finish_reason:
                self.done.add(index)
            if self.req.kind == "chat":
                lp = self.logprobs.chat(entries) if entries is not None else None
                delta = {"content": c.delta_text} if c.delta_text else {}
                choices.append({"index": index, "delta": delta, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            else:
                offset = self.text_offset.get(index, 0)
                lp = self.logprobs.completion(entries, offset) if entries is not None else None
                self.text_offset[index] = offset + len(c.delta_text)
                choices.append(R.completion_choice(index, c, c.delta_text, lp))
        return choices

    def chunk(self, choices: list[dict], counter: R.UsageCounter) -> dict:
        include = self.req.include_usage
        usage_body = counter.body() if include and self.req.continuous_usage_stats else None
        return R.envelope(self.req.kind, self.response_id, self.created, self.model, choices,
                          stream=True, usage_body=usage_body, include_usage_key=include)
