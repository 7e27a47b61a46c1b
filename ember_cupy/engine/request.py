"""A request: its prompt, its n sequences, and what has been reported of them."""
from __future__ import annotations

from dataclasses import dataclass, field

from ember_cupy.detokenizer import IncrementalDetokenizer
from ember_cupy.engine.sampler import TokenLogprobs
from ember_cupy.engine.sequence import Sequence
from ember_cupy.outputs import CompletionOutput, RequestOutput
from ember_cupy.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    fork_pending: bool = False          # n > 1: the parent forks once its prompt is computed
    _new_tokens: dict[int, list[int]] = field(default_factory=dict)
    _new_text: dict[int, str] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return not self.fork_pending and all(seq.is_finished for seq in self.seqs)

    def note_token(self, seq: Sequence, token_id: int, text: str) -> None:
        self._new_tokens.setdefault(seq.index, []).append(token_id)
        self._new_text[seq.index] = self._new_text.get(seq.index, "") + text

    def make_output(self) -> RequestOutput:
        """An output with everything so far, and the deltas since the previous output."""
        outputs = []
        for seq in sorted(self.seqs, key=lambda s: s.index):
            logprobs = self.logprobs.get(seq.index) if self.params.logprobs is not None else None
            outputs.append(CompletionOutput(
                index=seq.index,
                text=self.detokenizers[seq.index].text[:self.detokenizers[seq.index].emitted],
                token_ids=seq.output_token_ids,
                delta_text=self._new_text.get(seq.index, ""),
                delta_token_ids=self._new_tokens.get(seq.index, []),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=logprobs,
                cumulative_logprob=sum(lp.logprob for lp in logprobs) if logprobs else None,
            ))
        self._new_tokens, self._new_text = {}, {}
        first = self.seqs[0]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, outputs=outputs,
                             finished=self.finished, num_cached_tokens=first.stats.num_cached_tokens,
                             prompt_logprobs=self.prompt_logprobs, metrics=first.stats)
