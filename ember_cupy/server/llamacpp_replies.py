"""A request's outputs -> llama-server's /completion results: one event per delta while streaming
(server-sent events, no [DONE]: the last event has stop=true), or one object in all.

The last event (and the whole result) carries what llama-server's does: stop_type (eos, limit,
word), stopping_word, the counts, the generation settings and the timings in milliseconds (prompt:
from the first scheduling to the first token; predicted: from there to the last token).
response_fields keeps only the fields asked for, "a/b" lifting field b of object a to the top.
"""
from __future__ import annotations

from ember_cupy.server.completion_bodies import LogprobFormatter

NO_SLOT = -1   # no slots here: every request may run beside the others


def stop_type(finish_reason: str | None, stop_reason) -> str:
    if finish_reason == "length":
        return "limit"
    if finish_reason == "stop":
        return "word" if isinstance(stop_reason, str) else "eos"
    return "none"   # aborted


def _per(count: int, milliseconds: float) -> tuple[float, float]:
    """(milliseconds per token, tokens per second), 0 where nothing was timed."""
    if count <= 0 or milliseconds <= 0:
        return 0.0, 0.0
    return milliseconds / count, count * 1e3 / milliseconds


def _milliseconds(start: float | None, end: float | None) -> float:
    return max((end - start) * 1e3, 0.0) if start is not None and end is not None else 0.0


def selected(result: dict, fields: list[str] | None) -> dict:
    """response_fields: the fields asked for that exist, "a/b" read from result["a"]["b"]."""
    if fields is None:
        return result
    out = {}
    for path in fields:
        value, found = result, True
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                found = False
                break
            value = value[key]
        if found:
            out[path] = value
    return out


class LlamaCppReply:
    """The events or the result of one prompt's completion."""

    def __init__(self, index: int, model: str, prompt: str, settings: dict, tokenizer, *, n_probs: int,
                 return_tokens: bool, timings_per_token: bool, response_fields: list[str] | None):
        self.index = index
        self.model = model
        self.n_ctx = settings["n_ctx"]
        self.prompt = prompt
        self.settings = settings
        self.logprobs = LogprobFormatter(tokenizer) if n_probs else None
        self.return_tokens = return_tokens
        self.timings_per_token = timings_per_token
        self.response_fields = response_fields
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.probabilities: list[dict] = []
        self.prompt_token_ids: list[int] = []
        self.num_cached_tokens = 0
        self.metrics = None
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.computed = True   # False: n_predict 0, nothing was run

    def feed(self, output) -> list[dict]:
        """The stream events a delta output makes: one with its text and ids (if any), and the
        last one when it finishes."""
        c = output.outputs[0]
        self.prompt_token_ids = output.prompt_token_ids
        self.num_cached_tokens = output.num_cached_tokens
        self.metrics = output.metrics or self.metrics
        self.texts.append(c.text)
        self.token_ids += c.token_ids
        probabilities = self.logprobs.llamacpp(c.logprobs) if self.logprobs and c.logprobs else []
        self.probabilities += probabilities
        events = []
        if c.text or c.token_ids:
            events.append(self._partial(c.text, c.token_ids, probabilities))
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
            if not self.failed:
                events.append(selected(self._last("", []), self.response_fields))
        return events

    def nothing_asked(self, prompt_token_ids: list[int]) -> None:
        """n_predict 0: the result of a request that generates nothing."""
        self.prompt_token_ids, self.finish_reason, self.computed = prompt_token_ids, "length", False

    @property
    def failed(self) -> bool:
        """The output constraint failed mid-way: the reply ends with an error instead."""
        return self.finish_reason == "error"

    def whole(self) -> dict:
        """stream=false: the result, every text and id in it."""
        body = self._last("".join(self.texts), self.token_ids if self.return_tokens else [])
        if self.logprobs:
            body["completion_probabilities"] = self.probabilities
        return selected(body, self.response_fields)

    def _partial(self, text: str, token_ids: list[int], probabilities: list[dict]) -> dict:
        event = {"index": self.index, "content": text, "tokens": list(token_ids), "stop": False, "id_slot": NO_SLOT,
                 "tokens_predicted": len(self.token_ids), "tokens_evaluated": len(self.prompt_token_ids)}
        if probabilities:
            event["completion_probabilities"] = probabilities
        if self.timings_per_token:
            event["timings"] = self._timings()
        return event

    def _last(self, text: str, token_ids: list[int]) -> dict:
        stop = stop_type(self.finish_reason, self.stop_reason)
        full_text = "".join(self.texts)
        return {"index": self.index, "content": text, "tokens": list(token_ids), "id_slot": NO_SLOT, "stop": True,
                "model": self.model, "tokens_predicted": len(self.token_ids),
                "tokens_evaluated": len(self.prompt_token_ids), "generation_settings": self.settings,
                "prompt": self.prompt, "has_new_line": "\n" in full_text, "truncated": self._filled_context(),
                "stop_type": stop,
                "stopping_word": self.stop_reason if stop == "word" else "",
                "tokens_cached": max(len(self.prompt_token_ids) + len(self.token_ids) - 1, 0),
                "timings": self._timings()}

    def _filled_context(self) -> bool:
        """llama-server's `truncated`: the text stopped because the context was full."""
        return self.finish_reason == "length" and len(self.prompt_token_ids) + len(self.token_ids) >= self.n_ctx

    def _timings(self) -> dict:
        m = self.metrics
        scheduled, first, last = ((m.first_scheduled_time, m.first_token_time, m.last_token_time or m.finished_time)
                                  if m is not None else (None, None, None))
        prompt_n = max(len(self.prompt_token_ids) - self.num_cached_tokens, 0) if self.computed else 0
        prompt_ms, predicted_ms = _milliseconds(scheduled, first), _milliseconds(first, last)
        prompt_per_token, prompt_per_second = _per(prompt_n, prompt_ms)
        predicted_per_token, predicted_per_second = _per(len(self.token_ids), predicted_ms)
        return {"cache_n": self.num_cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_per_token, "prompt_per_second": prompt_per_second,
                "predicted_n": len(self.token_ids), "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_per_token, "predicted_per_second": predicted_per_second}
