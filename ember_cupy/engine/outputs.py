"""What the engine hands back after each step, per request, and how deltas are merged.

Output kinds (vLLM's RequestOutputKind), chosen per request in LLMEngine.add_request:
  CUMULATIVE  every step: all text, token ids and logprobs so far (and the step's delta);
  DELTA       every step: only what the step added (a stream: memory linear in the output);
  FINAL_ONLY  once, when the request finishes, with everything.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ember_cupy.engine.token_logprobs import TokenLogprobs
from ember_cupy.engine.sequence import Sequence, SequenceStats


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class CompletionOutput:
    index: int
    text: str                               # all text so far (DELTA: the step's text)
    token_ids: list[int]                    # all generated token ids so far (DELTA: the step's)
    delta_text: str = ""                    # text released by this step
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None        # "stop" | "length" | "abort" | "error" (LLM.chat: "tool_calls")
    stop_reason: str | int | None = None    # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None   # one per token of token_ids
    cumulative_logprob: float | None = None
    tool_calls: list | None = None          # LLM.chat with tools: ember_cupy.tool_calls.ToolCall

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
    prompt_logprobs: list[TokenLogprobs | None] | None = None   # DELTA: in the first output only
    metrics: SequenceStats | None = None    # over all n sequences (ember_cupy.engine.sequence.merge_stats)
    # an embedding request (ember_cupy/engine/pooling.py): its pooled vector, outputs empty;
    # None when it was aborted before its prompt was computed
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's result for one prompt, shaped as vLLM's (`.outputs.embedding`); `.embedding`
    reads the same vector."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0

    @property
    def embedding(self) -> list[float]:
        return self.outputs.embedding

    @classmethod
    def of(cls, output: RequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, output.prompt, output.prompt_token_ids, EmbeddingOutput(output.embedding),
                   output.finished, output.num_cached_tokens)


@dataclass
class EngineStepOutput:
    """What one engine step computed, before any text (the output processor's input,
    engine/output_processor.py): the tokens the scheduler appended to each sampling sequence and
    their logprobs, the prompt logprob entries of its prompt rows, the pooled hidden states of the
    embedding sequences whose prompt ended."""
    sampled: list[tuple[Sequence, list[int], list[TokenLogprobs | None]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[Sequence, int, list[TokenLogprobs]]] = field(default_factory=list)  # (seq, first)
    pooled: list[tuple[Sequence, object]] = field(default_factory=list)   # (seq, its last token's hidden row)

    def __bool__(self) -> bool:
        """Whether the step computed anything for a request (an idle step did not)."""
        return bool(self.sampled or self.prompt_logprobs or self.pooled)


class _Pieces:
    __slots__ = ("texts", "token_ids", "logprobs", "last")

    def __init__(self):
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = None
        self.last: CompletionOutput | None = None


class DeltaAccumulator:
    """Merges consecutive DELTA outputs of one request into one DELTA output: what a slow
    stream reader is handed in one piece, and, from the first output on, the full answer."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self._latest: RequestOutput | None = None
        self._prompt_logprobs = None
        self._pieces: dict[int, _Pieces] = {}
        self.num_chars = 0        # text held, in characters
        self.num_token_ids = 0    # token ids held

    def __bool__(self) -> bool:
        return self._latest is not None

    def add(self, output: RequestOutput) -> None:
        self._latest = output
        if self._prompt_logprobs is None:
            self._prompt_logprobs = output.prompt_logprobs
        for c in output.outputs:
            pieces = self._pieces.setdefault(c.index, _Pieces())
            pieces.texts.append(c.text)
            pieces.token_ids += c.token_ids
            if c.logprobs is not None:
                if pieces.logprobs is None:
                    pieces.logprobs = []
                pieces.logprobs += c.logprobs
            pieces.last = c
            self.num_chars += len(c.text)
            self.num_token_ids += len(c.token_ids)

    def take(self) -> RequestOutput | None:
        """The merged output (None if nothing was added since the last take), and a reset."""
        latest = self._latest
        if latest is None:
            return None
        outputs = []
        for index in sorted(self._pieces):
            pieces = self._pieces[index]
            text, last = "".join(pieces.texts), pieces.last
            outputs.append(CompletionOutput(
                index=index, text=text, token_ids=pieces.token_ids, delta_text=text,
                delta_token_ids=pieces.token_ids, finish_reason=last.finish_reason,
                stop_reason=last.stop_reason, logprobs=pieces.logprobs,
                cumulative_logprob=last.cumulative_logprob))
        merged = RequestOutput(latest.request_id, latest.prompt, latest.prompt_token_ids, outputs,
                               latest.finished, latest.num_cached_tokens, self._prompt_logprobs,
                               latest.metrics, latest.embedding)
        self._reset()
        return merged
