"""Bodies and stream chunks of /v1/completions and /v1/chat/completions, built from RequestOutputs."""
from __future__ import annotations

import json
import math

from ember_cupy.outputs import CompletionOutput, RequestOutput

_MIN_LOGPROB = -9999.0   # JSON has no -inf


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def sse(payload) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class UsageCounter:
    """Usage summed over the prompts of one request (a batched completion has several)."""

    def __init__(self):
        self.prompt: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.completion: dict[tuple[int, int], int] = {}

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        """output: a delta output (a stream's), or a whole one added once."""
        self.prompt[prompt_index] = len(output.prompt_token_ids)
        self.cached[prompt_index] = output.num_cached_tokens
        for c in output.outputs:
            key = (prompt_index, c.index)
            self.completion[key] = self.completion.get(key, 0) + len(c.token_ids)

    def body(self) -> dict:
        return usage(sum(self.prompt.values()), sum(self.completion.values()), sum(self.cached.values()))


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_bytes_text(token_id)

    def completion(self, entries, text_offset: int) -> dict:
        """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs, text_offset."""
        return self._legacy([(entry.token_id, entry) for entry in entries], text_offset)

    def echoed_prompt(self, token_ids: list[int], entries, k: int) -> dict:
        """The prompt's part of an echoed completion's logprobs, top k per token: the first token
        has none (nothing comes before it), as in OpenAI's and vLLM's replies."""
        entries = entries or [None] * len(token_ids)
        return self._legacy(list(zip(token_ids, entries)), 0, k)

    def _legacy(self, pairs, text_offset: int, k: int | None = None) -> dict:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in pairs:
            text = self._text(token_id)
            tokens.append(text)
            offsets.append(text_offset)
            text_offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(_finite(entry.logprob))
            top = {text: _finite(entry.logprob)}
            for top_id, logprob in entry.top[:k]:
                top.setdefault(self._text(top_id), _finite(logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def vllm_prompt(self, entries) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else token id ->
        {logprob, rank (1 = the likeliest; null when outside the top k), decoded_token}."""
        out = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            ranked = {token_id: (rank, logprob) for rank, (token_id, logprob) in enumerate(entry.top, 1)}
            ranked.setdefault(entry.token_id, (None, entry.logprob))
            out.append({str(token_id): {"logprob": _finite(logprob), "rank": rank,
                                        "decoded_token": self._text(token_id)}
                        for token_id, (rank, logprob) in ranked.items()})
        return out

    @staticmethod
    def joined(first: dict, second: dict) -> dict:
        return {key: first[key] + second[key] for key in first}

    def _bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (part of a UTF-8 character for some tokens), not its text's."""
        return list(self.tokenizer.token_bytes(token_id))

    def chat(self, entries) -> dict:
        content = []
        for entry in entries:
            text = self._text(entry.token_id)
            content.append({
                "token": text, "logprob": _finite(entry.logprob), "bytes": self._bytes(entry.token_id),
                "top_logprobs": [{"token": self._text(tid), "logprob": _finite(lp),
                                  "bytes": self._bytes(tid)} for tid, lp in entry.top],
            })
        return {"content": content}

    def llamacpp(self, entries) -> list[dict]:
        """llama-server's completion_probabilities: per token its id, text, bytes and logprob, and
        the top ones alike."""
        return [{**self._llamacpp_entry(entry.token_id, entry.logprob),
                 "top_logprobs": [self._llamacpp_entry(tid, lp) for tid, lp in entry.top]} for entry in entries]

    def _llamacpp_entry(self, token_id: int, logprob: float) -> dict:
        return {"id": token_id, "token": self._text(token_id), "bytes": self._bytes(token_id),
                "logprob": _finite(logprob)}


def completion_choice(index: int, c: CompletionOutput, text: str, logprobs: dict | None,
                      prompt_logprobs: list | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs,
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def chat_choice(index: int, c: CompletionOutput, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": c.text},
            "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def envelope(kind: str, response_id: str, created: int, model: str, choices: list, *,
             stream: bool, usage_body: dict | None = None, include_usage_key: bool = True) -> dict:
    if kind == "chat":
        obj = "chat.completion.chunk" if stream else "chat.completion"
    else:
        obj = "text_completion"
    body = {"id": response_id, "object": obj, "created": created, "model": model, "choices": choices}
    if include_usage_key:
        body["usage"] = usage_body
    return body


class ReturnedTokenIds:
    """vLLM's return_token_ids on a stream: the ids each choice generated since its last chunk
    (a chunk may be held back, e.g. while a stop string may be forming: its ids wait for the next)."""

    def __init__(self, wanted: bool):
        self.wanted = wanted
        self._pending: dict[int, list[int]] = {}

    def add(self, index: int, token_ids: list[int]) -> None:
        if self.wanted:
            self._pending.setdefault(index, []).extend(token_ids)

    def put(self, choice: dict, index: int) -> dict:
        """choice with the ids that wait for it, when they are wanted."""
        if self.wanted:
            choice["token_ids"] = self._pending.pop(index, [])
        return choice
