"""Speculative decoding's configuration, with vLLM's `--speculative-config` keys and meanings.

`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`
drafts by prompt lookup (ember_cupy/engine/ngram_proposer.py); `{"model": PATH,
"num_speculative_tokens": k}` by a smaller model of the same vocabulary, decoding greedily (method
"draft_model", ember_cupy/engine/draft_proposer.py).
As in vLLM, prompt_lookup_min and _max default to each other, and both to 5 when neither is given.
disable_by_batch_size (vLLM's): no drafts while at least that many sequences run; without it the
engine decides from measured step costs (ember_cupy/engine/speculation_gate.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from ember_cupy.checks import require


METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP = 5


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    method: str | None = None            # None: "draft_model" when model is given, else "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None             # the draft model: a .gguf path or a Hugging Face directory
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if self.method is None:
            set_("method", "draft_model" if self.model else "ngram")
        require(self.method in METHODS,
                f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        require(_is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
                f"speculative_config.num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens!r}")
        require(self.disable_by_batch_size is None or (_is_int(self.disable_by_batch_size)
                                                        and self.disable_by_batch_size >= 1),
                 "speculative_config.disable_by_batch_size must be an integer >= 1")
        if self.method == "draft_model":
            require(isinstance(self.model, str) and bool(self.model),
                    "speculative_config.model (the draft model's path) is required for method draft_model")
            return
        require(self.model is None, "speculative_config.model is only for method draft_model")
        low = self.prompt_lookup_min if self.prompt_lookup_min is not None else self.prompt_lookup_max
        high = self.prompt_lookup_max if self.prompt_lookup_max is not None else low
        low = DEFAULT_PROMPT_LOOKUP if low is None else low
        high = DEFAULT_PROMPT_LOOKUP if high is None else high
        require(_is_int(low) and low >= 1,
                f"speculative_config.prompt_lookup_min must be an integer >= 1, got {low!r}")
        require(_is_int(high) and high >= low,
                f"speculative_config.prompt_lookup_max must be an integer >= prompt_lookup_min ({low}), got {high!r}")
        set_("prompt_lookup_min", low)
        set_("prompt_lookup_max", high)

    @classmethod
    def from_value(cls, value) -> SpeculativeConfig | None:
        """A SpeculativeConfig, a dict of its fields, its JSON text (the CLI flag), or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        require(isinstance(value, dict), "speculative_config must be a JSON object (a dict)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        require(not unknown, f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        require("num_speculative_tokens" in value, "speculative_config.num_speculative_tokens is required")
        return cls(**value)
