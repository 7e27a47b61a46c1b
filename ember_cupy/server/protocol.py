"""Request bodies of /v1/completions and /v1/chat/completions -> validated GenerationRequest."""
from __future__ import annotations

from dataclasses import dataclass, field

from ember_cupy.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_LENGTH, MAX_STOP_STRINGS, SamplingParams
from ember_cupy.server.errors import APIError, bad_request, from_value_error
from ember_cupy.server.validation import Fields, is_int

MAX_PROMPTS = 64          # prompts in one batched completions request
MAX_SEQUENCES = MAX_N     # prompts x n of one request: each is a sequence to run
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1

# Fields OpenAI defines that we accept and ignore (they change nothing here).
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
COMMON = frozenset({
    "model", "stream", "stream_options", "n", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "seed",
    "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens", "priority", "cache_salt", "logprobs", "best_of", "prompt_logprobs",
}) | IGNORED
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                        "tool_choice", "add_generation_prompt", "chat_template_kwargs"}


@dataclass
class GenerationRequest:
    kind: str                          # "completion" | "chat"
    model: str | None
    params: SamplingParams
    prompts: list = field(default_factory=list)          # completion: str or token-id lists
    messages: list | None = None                         # chat
    add_generation_prompt: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    echo: bool = False
    priority: int = 0
    cache_salt: str | None = None


def parse_completion(body: dict, vocab_size: int) -> GenerationRequest:
    f = Fields(body, COMPLETION_FIELDS)
    if f.raw("suffix") is not None:
        raise APIError(400, "'suffix' is not supported", param="suffix", code="unsupported_parameter")
    logprobs = f.int("logprobs", None, 0, MAX_LOGPROBS)
    echo = f.bool("echo", False)
    if echo and logprobs is not None:
        raise APIError(400, "'echo' together with 'logprobs' is not supported (no prompt logprobs)",
                       param="echo", code="unsupported_parameter")
    request = GenerationRequest("completion", model=_model(f), prompts=_prompts(f, vocab_size),
                                params=_sampling(f, vocab_size, logprobs, default_max_tokens=16), echo=echo)
    sequences = len(request.prompts) * request.params.n
    if sequences > MAX_SEQUENCES:
        raise bad_request(f"{len(request.prompts)} prompts x n={request.params.n} make {sequences} sequences; "
                          f"a request may run at most {MAX_SEQUENCES}", param="n")
    _common(f, request)
    return request


def parse_chat(body: dict, vocab_size: int) -> GenerationRequest:
    f = Fields(body, CHAT_FIELDS)
    messages = f.raw("messages")
    if messages is None:
        raise bad_request("'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be an array of messages", param="messages", code="invalid_type")
    if not messages:
        raise bad_request("'messages' must not be empty", param="messages")
    want_logprobs = f.bool("logprobs", False)
    top = f.int("top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    _check_chat_extras(f)
    if f.has("max_completion_tokens"):
        max_tokens = f.int("max_completion_tokens", None, 1)
        max_field = "max_completion_tokens"
    else:
        max_tokens, max_field = None, "max_tokens"
    params = _sampling(f, vocab_size, (top or 0) if want_logprobs else None, default_max_tokens=None,
                       max_tokens=max_tokens, max_field=max_field)
    request = GenerationRequest("chat", model=_model(f), params=params, messages=messages,
                                add_generation_prompt=f.bool("add_generation_prompt", True),
                                chat_template_kwargs=f.dict("chat_template_kwargs") or {})
    _common(f, request)
    return request


def _check_chat_extras(f: Fields) -> None:
    fmt = f.dict("response_format")
    if fmt is not None and fmt.get("type") != "text":
        raise APIError(400, f"response_format type {fmt.get('type')!r} is not supported; only 'text'",
                       param="response_format", code="unsupported_parameter")
    tools = f.raw("tools")
    if tools is not None and (not isinstance(tools, list) or tools):
        raise APIError(400, "'tools' are not supported", param="tools", code="unsupported_parameter")
    choice = f.raw("tool_choice")
    if choice is not None and choice not in ("none", "auto"):
        raise APIError(400, "'tool_choice' must be 'none' or 'auto' (no tools are supported)",
                       param="tool_choice", code="unsupported_parameter")


def _model(f: Fields) -> str | None:
    return f.str("model", None)


def _common(f: Fields, request: GenerationRequest) -> None:
    request.stream = f.bool("stream", False)
    options = f.dict("stream_options")
    if options is not None:
        if not request.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        unknown = set(options) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise bad_request(f"unrecognized stream_options field: {sorted(unknown)[0]}",
                              param="stream_options", code="unknown_parameter")
        sub = Fields(options, {"include_usage", "continuous_usage_stats"})
        request.include_usage = sub.bool("include_usage", False)
        request.continuous_usage_stats = sub.bool("continuous_usage_stats", False)
    request.priority = f.int("priority", 0, -(1 << 31), (1 << 31) - 1)
    request.cache_salt = f.str("cache_salt", None, non_empty=True)


def _prompts(f: Fields, vocab_size: int) -> list:
    prompt = f.raw("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, str) or isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt) or isinstance(prompt, list) and prompt and all(
            isinstance(p, list) and all(is_int(t) for t in p) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise bad_request("'prompt' must not be empty", param="prompt")
    else:
        raise bad_request("'prompt' must be a string, an array of strings, an array of token ids, "
                          "or an array of arrays of token ids", param="prompt", code="invalid_type")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"'prompt' may hold at most {MAX_PROMPTS} prompts, got {len(prompts)}", param="prompt")
    for p in prompts:
        if not p:
            raise bad_request("'prompt' must not be empty", param="prompt")
        if isinstance(p, list):
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise bad_request(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                                  param="prompt")
    return prompts


def _logit_bias(f: Fields, vocab_size: int) -> dict | None:
    bias = f.dict("logit_bias")
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"'logit_bias' token id {token} is outside the vocabulary [0, {vocab_size})",
                              param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"'logit_bias' values must be numbers in [-100, 100], got {value!r}",
                              param="logit_bias")
        out[token] = float(value)
    return out


def _sampling(f: Fields, vocab_size: int, logprobs: int | None, default_max_tokens: int | None,
              max_tokens: int | None = None, max_field: str = "max_tokens") -> SamplingParams:
    if max_tokens is None:
        max_tokens = f.int("max_tokens", default_max_tokens, 1)
    n = f.int("n", 1, 1, MAX_N)
    best_of = f.int("best_of", None, 1)
    if best_of is not None and best_of != n:
        raise APIError(400, "'best_of' other than n is not supported", param="best_of",
                       code="unsupported_parameter")
    if f.raw("prompt_logprobs") is not None:
        raise APIError(400, "'prompt_logprobs' is not supported", param="prompt_logprobs",
                       code="unsupported_parameter")
    seed = f.int("seed", None, _SEED_MIN, _SEED_MAX)
    stop_token_ids = f.int_list("stop_token_ids", lo=0)
    bad = [t for t in stop_token_ids if t >= vocab_size]
    if bad:
        raise bad_request(f"'stop_token_ids' {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                          param="stop_token_ids")
    kwargs = dict(
        n=n,
        temperature=f.number("temperature", 1.0),
        top_p=f.number("top_p", 1.0),
        top_k=f.int("top_k", 0),
        min_p=f.number("min_p", 0.0),
        presence_penalty=f.number("presence_penalty", 0.0),
        frequency_penalty=f.number("frequency_penalty", 0.0),
        repetition_penalty=f.number("repetition_penalty", 1.0),
        logit_bias=_logit_bias(f, vocab_size),
        seed=None if seed is None else seed % (1 << 64),   # numpy seeds must be >= 0
        max_tokens=max_tokens,
        min_tokens=f.int("min_tokens", 0, 0),
        stop=tuple(f.str_list("stop", MAX_STOP_STRINGS, MAX_STOP_LENGTH)),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=f.bool("ignore_eos", False),
        logprobs=logprobs,
        include_stop_str_in_output=f.bool("include_stop_str_in_output", False),
        skip_special_tokens=f.bool("skip_special_tokens", True),
    )
    if max_tokens is not None and kwargs["min_tokens"] > max_tokens:
        raise bad_request(f"'min_tokens' ({kwargs['min_tokens']}) must be <= {max_field} ({max_tokens})",
                          param="min_tokens")
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise from_value_error(exc) from None
