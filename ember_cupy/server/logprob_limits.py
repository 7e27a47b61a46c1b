"""How many logprob entries one response may carry: the one rule for prompt and generated tokens.

An entry is one token's logprob or one of its top-k alternatives, so a token asked for with k top
logprobs is k + 1 entries. Prompt logprobs (vLLM's prompt_logprobs, a completion's echoed
logprobs) come once per choice of a completion, once per chat response; a non-streamed response
holds every generated token's logprobs at once (a stream sends them as they come, so only its
prompt logprobs, sent in one chunk, count). A non-streamed request without max_tokens (chat's
default: the rest of the context) generates at most the tokens whose logprobs fit, and ends with
finish_reason "length" there, rather than being refused for what it may never generate."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ember_cupy.server.errors import APIError
from ember_cupy.server.protocol import GenerationRequest

# about 8 MB of JSON (chat's entries, with their bytes, about 12 MB), held whole by the server
MAX_LOGPROB_ENTRIES = 1 << 17


@dataclass
class _Asked:
    param: str        # the request field that asks for them
    what: str         # "N prompt tokens" or "N generated tokens"
    tokens: int       # tokens that carry logprobs, every copy counted
    k: int | None     # top logprobs per token (None: not asked for)

    @property
    def entries(self) -> int:
        return self.tokens * (self.k + 1)


def check_logprob_entries(req: GenerationRequest, prompt_lengths: list[int], max_model_len: int) -> None:
    """A 400 naming the field that asks for most of them when the logprobs asked for would make a
    response of more than MAX_LOGPROB_ENTRIES entries; without max_tokens, req.params gets the
    max_tokens that fits."""
    _fit_default_max_tokens(req, prompt_lengths, max_model_len)
    asked = [a for a in _asked(req, prompt_lengths, max_model_len) if a.k is not None]
    entries = sum(a.entries for a in asked)
    if entries <= MAX_LOGPROB_ENTRIES:
        return
    top = max(asked, key=lambda a: a.entries)
    parts = ", ".join(f"{a.param}: {a.what} x {a.k + 1}" for a in asked)
    raise APIError(400, f"the logprobs asked for would make {entries} entries in one response ({parts}); a "
                        f"response may carry at most {MAX_LOGPROB_ENTRIES}: ask for fewer top logprobs, "
                        f"tokens (max_tokens) or choices (n), or stream the reply",
                   param=top.param, code="invalid_value")


def _asked(req: GenerationRequest, prompt_lengths: list[int], max_model_len: int) -> list[_Asked]:
    n = req.params.n
    copies = n if req.kind == "completion" else 1
    prompt_tokens = sum(prompt_lengths) * copies
    prompt_what = f"{sum(prompt_lengths)} prompt tokens x {copies} choice(s)"
    asked = [_Asked("prompt_logprobs", prompt_what, prompt_tokens, req.prompt_logprobs)]
    if req.echo:
        asked.append(_Asked("logprobs", prompt_what, prompt_tokens, req.params.logprobs))
    if not req.stream:
        max_tokens = req.params.max_tokens
        generated = sum(n * min(max_tokens or max_model_len, max(0, max_model_len - length))
                        for length in prompt_lengths)
        asked.append(_Asked(_generated_param(req), f"up to {generated} generated tokens", generated,
                            req.params.logprobs))
    return asked


def _fit_default_max_tokens(req: GenerationRequest, prompt_lengths: list[int], max_model_len: int) -> None:
    """A non-streamed request with generated logprobs and no max_tokens: max_tokens becomes the
    tokens whose logprobs fit in what the prompt logprobs leave (at least 1; the check then
    refuses what cannot fit at all), when that is less than the context left."""
    params = req.params
    if req.stream or params.max_tokens is not None or params.logprobs is None:
        return
    prompt_entries = sum(a.entries for a in _asked(req, prompt_lengths, max_model_len)[:-1] if a.k is not None)
    per_token = params.n * len(prompt_lengths) * (params.logprobs + 1)
    fitting = max(1, (MAX_LOGPROB_ENTRIES - prompt_entries) // per_token)
    if fitting < max_model_len - max(prompt_lengths):
        req.params = dataclasses.replace(params, max_tokens=fitting)


def _generated_param(req: GenerationRequest) -> str:
    if req.kind == "chat" and req.body.top_logprobs is not None:
        return "top_logprobs"
    return "logprobs"
