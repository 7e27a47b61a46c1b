"""A validated request body -> GenerationRequest: what the serving layer runs and replies with."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pydantic import ValidationError

from ember_cupy.sampling_params import MAX_N, SamplingParams
from ember_cupy.server.errors import APIError, bad_request, from_validation_error, from_value_error
from ember_cupy.server.protocol.constraints import structured_constraint
from ember_cupy.server.protocol.requests import ChatCompletionRequest, CompletionRequest, SamplingFields
from ember_cupy.structured import StructuredOutputsParams

MAX_SEQUENCES = MAX_N     # prompts x n of one request: each is a sequence to run


@dataclass
class GenerationRequest:
    kind: str                          # "completion" | "chat"
    model: str | None
    params: SamplingParams
    body: CompletionRequest | ChatCompletionRequest   # every field, typed
    prompts: list = field(default_factory=list)          # completion: str or token-id lists
    messages: list | None = None                         # chat: dicts for the chat template
    add_generation_prompt: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    echo: bool = False
    priority: int = 0
    cache_salt: str | None = None
    prompt_logprobs: int | None = None   # vLLM's field: reply with the prompt's logprobs, top k
    constraint: StructuredOutputsParams | None = None   # structured_constraint(body): None = free text


def validate(model: type, body: dict, vocab_size: int | None = None):
    """body as `model`, or a 400 naming the first bad field."""
    try:
        return model.model_validate(body, context={"vocab_size": vocab_size})
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def parse_completion(body: dict, vocab_size: int) -> GenerationRequest:
    request: CompletionRequest = validate(CompletionRequest, body, vocab_size)
    echo_logprobs = request.logprobs if request.echo else None   # the prompt's, in the echoed text's
    params = _sampling(request, request.logprobs, request.max_tokens, "max_tokens", echo_logprobs)
    sequences = len(request.prompt) * params.n
    if sequences > MAX_SEQUENCES:
        raise bad_request(f"{len(request.prompt)} prompts x n={params.n} make {sequences} sequences; "
                          f"a request may run at most {MAX_SEQUENCES}", param="n")
    return _generation("completion", request, params, prompts=request.prompt, echo=request.echo)


def parse_chat(body: dict, vocab_size: int) -> GenerationRequest:
    request: ChatCompletionRequest = validate(ChatCompletionRequest, body, vocab_size)
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    if request.max_completion_tokens is not None:
        max_tokens, max_field = request.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_field = request.max_tokens, "max_tokens"
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = _sampling(request, logprobs, max_tokens, max_field)
    return _generation("chat", request, params, messages=[m.template_dict() for m in request.messages],
                       add_generation_prompt=request.add_generation_prompt,
                       chat_template_kwargs=request.chat_template_kwargs or {})


def _generation(kind: str, request: SamplingFields, params: SamplingParams, **fields) -> GenerationRequest:
    if request.stream_options is not None and not request.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    options = request.stream_options
    return GenerationRequest(
        kind, model=request.model, params=params, body=request, stream=request.stream,
        include_usage=bool(options and options.include_usage),
        continuous_usage_stats=bool(options and options.continuous_usage_stats),
        priority=request.priority, cache_salt=request.cache_salt, prompt_logprobs=request.prompt_logprobs,
        constraint=structured_constraint(request),
        **fields)


def _sampling(request: SamplingFields, logprobs: int | None, max_tokens: int | None, max_field: str,
              echo_logprobs: int | None = None) -> SamplingParams:
    if request.best_of is not None and request.best_of != request.n:
        raise APIError(400, "'best_of' other than n is not supported", param="best_of",
                       code="unsupported_parameter")
    asked = [k for k in (request.prompt_logprobs, echo_logprobs) if k is not None]
    if max_tokens is not None and request.min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({request.min_tokens}) must be <= {max_field} ({max_tokens})",
                          param="min_tokens")
    try:
        return SamplingParams(
            n=request.n, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
            min_p=request.min_p, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
            logit_bias={int(k): v for k, v in request.logit_bias.items()} if request.logit_bias else None,
            seed=None if request.seed is None else request.seed % (1 << 64),   # numpy seeds must be >= 0
            max_tokens=max_tokens, min_tokens=request.min_tokens, stop=tuple(request.stop),
            stop_token_ids=tuple(request.stop_token_ids), allowed_token_ids=request.allowed_token_ids,
            bad_words=tuple(request.bad_words),
            ignore_eos=request.ignore_eos, logprobs=logprobs,
            prompt_logprobs=max(asked) if asked else None,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens, truncate_prompt_tokens=request.truncate_prompt_tokens,
            speculative=request.speculative)
    except ValueError as exc:
        raise from_value_error(exc) from None


def with_sampling_defaults(req: GenerationRequest, defaults: dict) -> None:
    """The model's default sampling parameters (--generation-config) for the fields the body left out."""
    given = req.body.model_fields_set
    changes = {k: v for k, v in defaults.items() if k != "max_tokens" and k not in given}
    if "max_tokens" in defaults and not given & {"max_tokens", "max_completion_tokens"}:
        changes["max_tokens"] = defaults["max_tokens"]
    if changes:
        try:
            req.params = dataclasses.replace(req.params, **changes)
        except ValueError as exc:
            raise from_value_error(exc) from None
