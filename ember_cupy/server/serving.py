"""/v1/completions and /v1/chat/completions: admission, full responses and SSE streams."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid

from aiohttp import web

from ember_cupy import tool_calls
from ember_cupy.sampling_params import MAX_LOGPROBS, truncate_prompt
from ember_cupy.server import completion_bodies as R
from ember_cupy.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
    EngineOverloadedError,
    PrepareTimeoutError,
)
from ember_cupy.server.errors import APIError, from_value_error
from ember_cupy.server.logprob_limits import check_logprob_entries
from ember_cupy.server.protocol import GenerationRequest, parse_chat, parse_completion, with_sampling_defaults
from ember_cupy.server.output_parsers import ChatDeltas, OutputParsers
from ember_cupy.server.protocol.constraints import tool_spec
from ember_cupy.server.request_stream import RequestStream
from ember_cupy.server.validation import read_json_body

log = logging.getLogger("ember_cupy.server")
RETRY_AFTER_SECONDS = 1
# the prompt tokens of one request, all its prompts (or embedding inputs) together: what one
# request may make the engine prefill (--max-prompt-tokens-per-request)
DEFAULT_MAX_PROMPT_TOKENS_PER_REQUEST = 32768


def engine_error(exc: BaseException) -> APIError:
    """Map what AsyncEngine raises to an HTTP error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), code="server_overloaded",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, PrepareTimeoutError):
        return APIError(408, str(exc), code="timeout")
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
    def __init__(self, engine: AsyncEngine, model_names: list[str],
                 max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS_PER_REQUEST,
                 output_parsers: OutputParsers = OutputParsers(), max_logprobs: int = MAX_LOGPROBS):
        self.engine = engine
        self.model_names = model_names
        self.max_prompt_tokens = max_prompt_tokens
        self.output_parsers = output_parsers
        self.max_logprobs = max_logprobs

    def ensure_ready(self) -> None:
        if not self.engine.is_ready:
            raise engine_error(EngineDeadError(f"the engine is dead: {self.engine.error}")
                               if self.engine.error else EngineNotReadyError(
                                   f"the engine is {self.engine.state.value}"))

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"the model '{name}' does not exist; served: {self.model_names}",
                           param="model", code="model_not_found")

    def check_request(self, req: GenerationRequest) -> None:
        """The server's rules for a parsed request: its model, priority and logprobs, and the model's
        default sampling parameters for the fields it left out."""
        self.check_model(req.model)
        self.check_priority(req)
        self.check_logprobs(req)
        with_sampling_defaults(req, self.engine.model_info().sampling_defaults)

    def check_logprobs(self, req: GenerationRequest) -> None:
        """--max-logprobs (vLLM's): the most top logprobs a request may ask, per token or prompt position."""
        for name, asked in (("logprobs", req.params.logprobs), ("prompt_logprobs", req.params.prompt_logprobs)):
            if asked is not None and asked > self.max_logprobs:
                raise APIError(400, f"{asked} {name} asked; this server allows at most {self.max_logprobs} "
                                    f"(--max-logprobs)", param=name, code="invalid_value")

    def check_priority(self, req: GenerationRequest) -> None:
        """As vLLM: a priority means something only under the priority policy, so it is refused
        elsewhere rather than silently ignored."""
        policy = self.engine.model_info().policy
        if req.priority != 0 and policy != "priority":
            raise APIError(400, f"'priority' {req.priority} needs the server's priority scheduling policy "
                                f"(--policy priority); it runs with '{policy}'", param="priority",
                           code="unsupported_parameter")

    async def tokenize_prompts(self, prompts: list, param: str, *, add_special_tokens: bool,
                               params=None) -> list[list[int]]:
        """Each prompt's token ids (a string tokenized off the loop; token ids as they are), cut to
        the params' truncate_prompt_tokens (as the engine will), refused with a 400 naming `param`
        when all together they exceed max_prompt_tokens.
        add_special_tokens: False for a prompt the chat template rendered (it wrote them)."""
        token_ids = []
        for index, prompt in enumerate(prompts):
            try:
                token_ids.append(await self.engine.tokenize(prompt, add_special_tokens)
                                 if isinstance(prompt, str) else prompt)
            except ValueError as exc:
                error = from_value_error(exc, param=param)
                if len(prompts) > 1:
                    error.message = f"{param}[{index}]: {error.message}"
                raise error from None
            except Exception as exc:   # noqa: BLE001 - overloaded, timed out: an HTTP error each
                raise engine_error(exc) from None
        if params is not None and params.truncate_prompt_tokens is not None:
            token_ids = [truncate_prompt(ids, params, self.engine.max_model_len) for ids in token_ids]
        self.check_prompt_total(token_ids, param)
        return token_ids

    def check_prompt_total(self, token_ids: list[list[int]], param: str) -> None:
        """--max-prompt-tokens-per-request over all the prompts of a request."""
        total = sum(map(len, token_ids))
        if total > self.max_prompt_tokens:
            raise APIError(400, f"the request's prompts have {total} tokens in all; a request may have at most "
                                f"{self.max_prompt_tokens} (--max-prompt-tokens-per-request)",
                           param=param, code="context_length_exceeded")

    # --- endpoints ------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json_body(request)
        self.ensure_ready()
        req = parse_completion(body, self.engine.tokenizer.vocab_size)
        self.check_request(req)
        req.params = dataclasses.replace(req.params, structured_outputs=req.constraint)
        token_ids = await self.tokenize_prompts(req.prompts, "prompt", add_special_tokens=True, params=req.params)
        check_logprob_entries(req, [len(ids) for ids in token_ids], self.engine.max_model_len)
        # truncated prompts run (and echo) as the token ids that are left
        prompts = req.prompts if req.params.truncate_prompt_tokens is None else token_ids
        return await self._generate(request, req, prompts, token_ids)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req, prompt, tools = await self.prepare_chat(await read_json_body(request))
        token_ids = await self.tokenize_prompts([prompt], "messages", add_special_tokens=False, params=req.params)
        check_logprob_entries(req, [len(token_ids[0])], self.engine.max_model_len)
        return await self._generate(request, req, [prompt], token_ids, tools)

    async def prepare_chat(self, body: dict) -> tuple[GenerationRequest, str, tool_calls.ToolSpec]:
        """A chat body -> (its request with the sampling params and output constraint, the prompt
        from the chat template, the tools): what /v1/chat/completions and /v1/responses run."""
        self.ensure_ready()
        req = parse_chat(body, self.engine.tokenizer.vocab_size)
        self.check_request(req)
        tools = tool_spec(req.body)
        supports_tools = tool_calls.template_supports_tools(self.engine.tokenizer)
        try:
            req.params = tool_calls.constrain(dataclasses.replace(req.params, structured_outputs=req.constraint),
                                              tools, supports_tools)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice", code="invalid_value") from None
        try:
            prompt = await self.engine.off_loop(
                tool_calls.render_chat, self.engine.tokenizer, req.messages, tools,
                add_generation_prompt=req.add_generation_prompt, work_chars=text_chars(req.messages),
                **req.chat_template_kwargs)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from None
        except Exception as exc:   # noqa: BLE001 - overloaded, timed out: an HTTP error each
            raise engine_error(exc) from None
        try:
            req.params = self.output_parsers.constrain_answer(req.params, prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="structured_outputs", code="invalid_value") from None
        return req, prompt, tools

    # --- generation -----------------------------------------------------------------------
    async def _admit(self, req: GenerationRequest, prompts: list, token_ids: list[list[int]],
                     response_id: str) -> list[RequestStream]:
        admissions = [self.engine.add_request(p, req.params, request_id=f"{response_id}-{i}",
                                              priority=req.priority, cache_salt=req.cache_salt,
                                              prompt_token_ids=ids if isinstance(p, str) else None, prompt_index=i)
                      for i, (p, ids) in enumerate(zip(prompts, token_ids, strict=True))]
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

    async def _generate(self, request: web.Request, req: GenerationRequest, prompts: list,
                        token_ids: list[list[int]], tools: tool_calls.ToolSpec = tool_calls.NO_TOOLS):
        prefix = "chatcmpl-" if req.kind == "chat" else "cmpl-"
        response_id = prefix + uuid.uuid4().hex
        streams = await self._admit(req, prompts, token_ids, response_id)
        try:
            ctx = _Context(self, req, response_id, prompts, tools, token_ids)
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
        params = ctx.req.params
        if params.logprobs is None and params.prompt_logprobs is None:
            return web.json_response(_full_body(ctx, finals))
        # up to 131072 logprob entries: ~0.5 s of Python that would stall every other request
        text = await asyncio.to_thread(lambda: json.dumps(_full_body(ctx, finals)))
        return web.Response(text=text, content_type="application/json")

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


def _full_body(ctx: _Context, finals: list) -> dict:
    choices, counter = [], R.UsageCounter()
    for prompt_index, output in enumerate(finals):
        counter.add(prompt_index, output)
        for c in output.outputs:
            choices.append(ctx.full_choice(prompt_index, output, c))
    choices.sort(key=lambda ch: ch["index"])
    body = R.envelope(ctx.req.kind, ctx.response_id, ctx.created, ctx.model, choices,
                      stream=False, usage_body=counter.body())
    body.update(ctx.full_body_extras(finals))
    return body


def text_chars(messages: list[dict]) -> int:
    """The characters of a conversation's text contents (which worker threads render it)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return total


class _Context:
    """What one response needs to turn outputs into choices: ids, offsets, what was sent."""

    def __init__(self, serving: OpenAIServing, req: GenerationRequest, response_id: str, prompts: list,
                 tools: tool_calls.ToolSpec = tool_calls.NO_TOOLS, prompt_token_ids: list[list[int]] = ()):
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
        self.tools = tools
        self.supports_tools = tool_calls.template_supports_tools(self.tokenizer)
        self.parsers = serving.output_parsers
        self.chat_deltas: dict[int, ChatDeltas] = {}   # by choice index
        self.chat_prompt_logprobs: list | None = None   # for the next chunk's envelope (vLLM's)
        self.prompt_logprobs: dict[int, list] = {}      # by prompt index: outputs may carry them once
        self.token_ids = R.ReturnedTokenIds(bool(req.body.return_token_ids))
        # chat, return_token_ids: the prompt's ids go in the envelope of the first chunk (vLLM's)
        self.chat_prompt_ids = list(prompt_token_ids[0]) if self.token_ids.wanted and req.kind == "chat" else None

    def _prompt_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def full_choice(self, prompt_index: int, output, c) -> dict:
        index = prompt_index * self.n + c.index
        if self.req.kind == "chat":
            lp = self.logprobs.chat(c.logprobs) if c.logprobs is not None else None
            choice = R.chat_choice(index, c, lp)
            self.parsers.full_message(choice, c.text, self._prompt_text(prompt_index), self.tools,
                                      self.supports_tools)
        else:
            choice = self._completion_choice(prompt_index, index, output, c, c.text, c.logprobs, 0)
        self.token_ids.add(index, c.token_ids)
        return self.token_ids.put(choice, index)

    def _completion_choice(self, prompt_index: int, index: int, output, c, text: str, entries,
                           offset: int, first: bool = True) -> dict:
        """A completion choice; the first of its index carries the echoed prompt (with its
        logprobs when logprobs are asked for) and vLLM's prompt_logprobs."""
        prefix = self._prompt_text(prompt_index) if first and self.req.echo else ""
        lp = self.logprobs.completion(entries, offset + len(prefix)) if entries is not None else None
        if prefix and lp is not None:
            entries = self._prompt_entries(prompt_index, output)
            echoed = self.logprobs.echoed_prompt(output.prompt_token_ids, entries, self.req.params.logprobs)
            lp = self.logprobs.joined(echoed, lp)
        self.text_offset[index] = offset + len(prefix) + len(text)
        vllm = self._vllm_prompt_logprobs(prompt_index, output) if first else None
        choice = R.completion_choice(index, c, prefix + text, lp, vllm)
        if first and self.token_ids.wanted:
            choice["prompt_token_ids"] = list(output.prompt_token_ids)
        return choice

    def _prompt_entries(self, prompt_index: int, output) -> list | None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs.setdefault(prompt_index, output.prompt_logprobs)
        return self.prompt_logprobs.get(prompt_index)

    def _vllm_prompt_logprobs(self, prompt_index: int, output) -> list | None:
        entries = self._prompt_entries(prompt_index, output)
        if self.req.prompt_logprobs is None or entries is None:
            return None
        return self.logprobs.vllm_prompt(entries)

    def full_body_extras(self, finals: list) -> dict:
        """Chat's prompt_logprobs and prompt_token_ids sit beside the choices (vLLM's shape)."""
        extras = {}
        if self.req.kind == "chat" and self.req.prompt_logprobs is not None:
            extras["prompt_logprobs"] = self._vllm_prompt_logprobs(0, finals[0])
        if self.chat_prompt_ids is not None:
            extras["prompt_token_ids"] = self.chat_prompt_ids
        return extras

    def first_chunks(self, num_prompts: int) -> list[dict]:
        """Chat: the assistant role for every choice. (An echoed prompt goes with the first
        output of each choice: its logprobs are known only once the prompt has run.)"""
        if self.req.kind == "chat":
            return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for i in range(num_prompts * self.n)]
        return []

    def stream_choices(self, prompt_index: int, output) -> list[dict]:
        choices = []
        for c in output.outputs:
            index = prompt_index * self.n + c.index
            if index in self.done:
                continue
            self.token_ids.add(index, c.token_ids)   # a delta output's: its new tokens
            entries = c.logprobs   # a delta output's: those of its new tokens
            first = index not in self.text_offset
            self.text_offset.setdefault(index, 0)
            says_prompt = first and (self.req.echo or self.req.prompt_logprobs is not None)
            if not c.delta_text and not c.finish_reason and not entries and not says_prompt:
                continue
            if c.finish_reason:
                self.done.add(index)
            if self.req.kind == "chat":
                lp = self.logprobs.chat(entries) if entries is not None else None
                if index not in self.chat_deltas:
                    self.chat_deltas[index] = ChatDeltas(self.parsers, self._prompt_text(prompt_index), self.tools,
                                                         self.supports_tools)
                delta, called = self.chat_deltas[index].delta(c.delta_text, bool(c.finish_reason))
                finish_reason = "tool_calls" if called else c.finish_reason
                if not delta and not finish_reason and not entries and not says_prompt:
                    continue
                if says_prompt:
                    self.chat_prompt_logprobs = self._vllm_prompt_logprobs(prompt_index, output)
                choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason,
                          "stop_reason": c.stop_reason}
            else:
                choice = self._completion_choice(prompt_index, index, output, c, c.delta_text, entries,
                                                 self.text_offset[index], first)
            choices.append(self.token_ids.put(choice, index))
        return choices

    def chunk(self, choices: list[dict], counter: R.UsageCounter) -> dict:
        include = self.req.include_usage
        usage_body = counter.body() if include and self.req.continuous_usage_stats else None
        body = R.envelope(self.req.kind, self.response_id, self.created, self.model, choices,
                          stream=True, usage_body=usage_body, include_usage_key=include)
        if self.chat_prompt_logprobs is not None:
            body["prompt_logprobs"], self.chat_prompt_logprobs = self.chat_prompt_logprobs, None
        if self.chat_prompt_ids is not None:
            body["prompt_token_ids"], self.chat_prompt_ids = self.chat_prompt_ids, None
        return body
