"""What the engine hands back after each step, per request."""
from __future__ import annotations

from dataclasses import dataclass, field

from ember_cupy.engine.sampler import TokenLogprobs
from ember_cupy.engine.sequence import SequenceStats


@dataclass
class CompletionOutput:
    index: int
    text: str                               # all text so far
    token_ids: list[int]                    # all generated token ids so far
    delta_text: str = ""                    # text released by this step
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None        # "stop" | "length" | "abort"
    stop_reason: str | int | None = None    # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: SequenceStats | None = None
