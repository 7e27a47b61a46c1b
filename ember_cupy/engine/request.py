"""A request: its prompt, its n sequences, and what has been reported of each of them."""
from __future__ import annotations

from dataclasses import dataclass, field

from ember_cupy.detokenizer import IncrementalDetokenizer
from ember_cupy.engine.outputs import CompletionOutput, OutputKind, RequestOutput
from ember_cupy.engine.sampler import TokenLogprobs
from ember_cupy.engine.sequence import Sequence, merge_stats
from ember_cupy.sampling_params import SamplingParams


@dataclass(eq=False)
class SequenceOutputState:
    """One sequence's text and logprobs: all of them (CUMULATIVE, FINAL_ONLY), or those not yet
    in an output (DELTA)."""
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    new_token_ids: list[int] = field(default_factory=list)   # since the previous output
    new_text: str = ""

    def add_token(self, token_id: int, text: str, logprobs: TokenLogprobs | None) -> None:
        self.new_token_ids.append(token_id)
        self.new_text += text
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs.logprob

    def make_output(self, kind: OutputKind, with_logprobs: bool) -> CompletionOutput:
        seq, new_ids, new_text = self.seq, self.new_token_ids, self.new_text
        logprobs = None
        if with_logprobs and kind is OutputKind.DELTA:   # handed on: a stream keeps none of them here
            logprobs, self.logprobs = self.logprobs, []
        elif with_logprobs:
            logprobs = list(self.logprobs)
        if kind is OutputKind.DELTA:
            text, token_ids = new_text, new_ids
        else:
            text, token_ids = self.detokenizer.text[:self.detokenizer.emitted], seq.output_token_ids
        self.new_token_ids, self.new_text = [], ""
        return CompletionOutput(
            index=seq.index, text=text, token_ids=token_ids, delta_text=new_text,
            delta_token_ids=new_ids, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            logprobs=logprobs, cumulative_logprob=self.cumulative_logprob if with_logprobs else None)


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer, output_kind: OutputKind = OutputKind.CUMULATIVE):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_kind = output_kind
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self._tokenizer = tokenizer
        self._states: dict[int, SequenceOutputState] = {}   # by sequence index
        self._prompt_logprobs_sent = False

    @property
    def seqs(self) -> list[Sequence]:
        return [state.seq for state in self._states.values()]

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def state(self, seq: Sequence) -> SequenceOutputState:
        """seq's output state, made on first sight (the forks of n > 1 appear in a step's samples)."""
        state = self._states.get(seq.index)
        if state is None:
            params = self.params
            detokenizer = IncrementalDetokenizer(self._tokenizer, params.stop,
                                                 params.include_stop_str_in_output, params.skip_special_tokens)
            state = self._states[seq.index] = SequenceOutputState(seq, detokenizer)
        return state

    def make_output(self) -> RequestOutput | None:
        """The output of the request's kind (None for FINAL_ONLY before the end)."""
        finished, kind = self.finished, self.output_kind
        if kind is OutputKind.FINAL_ONLY and not finished:
            return None
        with_logprobs = self.params.logprobs is not None
        outputs = [self._states[i].make_output(kind, with_logprobs) for i in sorted(self._states)]
        prompt_logprobs = self.prompt_logprobs
        if kind is OutputKind.DELTA:
            prompt_logprobs = None if self._prompt_logprobs_sent else prompt_logprobs
            self._prompt_logprobs_sent |= prompt_logprobs is not None
        seqs = self.seqs
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, outputs=outputs, finished=finished,
                             num_cached_tokens=seqs[0].stats.num_cached_tokens, prompt_logprobs=prompt_logprobs,
                             metrics=merge_stats([seq.stats for seq in seqs]))
