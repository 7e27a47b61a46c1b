"""OutputProcessor: what an engine step computed (token ids, logprobs, finish state) as
RequestOutputs: incremental text, stop strings, logprobs, the output kinds (vLLM v1's
OutputProcessor).

It runs after each step and before the next, in the thread of the engine's caller: the caller's
own for the offline LLM and LLMEngine.step(), the event loop for the server's AsyncEngine; never
in the step's worker thread. Between two steps it reads the sequences it is handed (the step is
over, the next not begun). A stop string ends its sequence through the `stop` callback it is
given (LLMEngine.stop_at_string), before the next step: no token after a stop string is computed,
and those a step verified past it (accepted drafts) are taken back, as if never generated.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ember_cupy.detokenizer import IncrementalDetokenizer
from ember_cupy.engine.outputs import CompletionOutput, EngineStepOutput, OutputKind, RequestOutput
from ember_cupy.engine.pooling import EmbeddingRequest
from ember_cupy.engine.token_logprobs import TokenLogprobs
from ember_cupy.engine.sequence import Sequence, merge_stats
from ember_cupy.sampling_params import SamplingParams

# stop(seq, stop_string, num_after): end seq at a stop string; its num_after newest tokens
# (those verified after the token that completed it) are taken back.
StopCallback = Callable[[Sequence, str, int], None]


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


class RequestState:
    """A generation request's prompt, the output state of each of its n sequences, and what has
    been reported of them."""

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

    def add_prompt_logprobs(self, first: int, entries: list[TokenLogprobs]) -> None:
        """The entries of prompt positions first, first + 1, ...; entry 0 (nothing before it) is None."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        self.prompt_logprobs[first:first + len(entries)] = entries

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


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, RequestState | EmbeddingRequest] = {}

    def add_request(self, seq: Sequence, prompt: str | None, params: SamplingParams,
                    output_kind: OutputKind) -> None:
        request = RequestState(seq.request_id, prompt, seq.prompt_token_ids, params, self.tokenizer, output_kind)
        request.state(seq)
        self.requests[seq.request_id] = request

    def add_embedding(self, request: EmbeddingRequest) -> None:
        self.requests[request.request_id] = request

    def abort(self, request_id: str) -> RequestOutput | None:
        """The last output of a request the engine has just aborted (None if unknown here)."""
        request = self.requests.pop(request_id, None)
        return None if request is None else request.make_output()

    def process(self, step: EngineStepOutput, stop: StopCallback) -> list[RequestOutput]:
        """The outputs of the requests the step touched, in order; finished requests are forgotten."""
        touched = []
        for seq, first, entries in step.prompt_logprobs:
            self.requests[seq.request_id].add_prompt_logprobs(first, entries)
        for seq, hidden in step.pooled:
            request = self.requests[seq.request_id]
            request.pool(hidden)
            touched.append(request)
        for seq, tokens, logprobs in step.sampled:
            request = self.requests[seq.request_id]
            self._detokenize_tokens(request, seq, tokens, logprobs, stop)
            touched.append(request)
        return self._collect_outputs(touched)

    def _detokenize_tokens(self, request: RequestState, seq: Sequence, tokens: list[int], logprobs,
                           stop: StopCallback) -> None:
        """The text side of the tokens the scheduler appended this step, in order."""
        if seq.finish_reason == "error":   # its grammar refused this token: the output ends before it
            state = request.state(seq)
            state.new_text += state.detokenizer.finish()
            return
        for index, (token_id, token_logprobs) in enumerate(zip(tokens, logprobs)):
            num_after = len(tokens) - 1 - index
            if self._detokenize(request, seq, token_id, token_logprobs, num_after, stop):
                return

    def _detokenize(self, request: RequestState, seq: Sequence, token_id: int, logprobs, num_after: int,
                    stop: StopCallback) -> bool:
        """One token's text; True when a stop string ends the sequence at it. num_after: tokens
        appended after it (none: it is the newest, on which the scheduler has ended the sequence,
        if at all: a stop token, EOS or max_tokens)."""
        params = request.params
        state = request.state(seq)
        if not params.detokenize:
            state.add_token(token_id, "", logprobs)
            return False
        detokenizer = state.detokenizer
        last = num_after == 0
        stopped_by_token = last and seq.finish_reason == "stop" and (
            token_id in params.stop_token_ids or token_id in self.eos_token_ids)
        stopped_here = False
        if not stopped_by_token or params.include_stop_str_in_output:
            can_stop = seq.num_output_tokens - num_after > params.min_tokens
            stop_string = detokenizer.add_tokens([token_id], check_stop=can_stop)
            if stop_string is not None:
                stop(seq, stop_string, num_after)
                stopped_here = True
        finished = stopped_here or (last and seq.is_finished)
        text = detokenizer.finish() if finished else detokenizer.release()
        state.add_token(token_id, text, logprobs)
        return stopped_here

    def _collect_outputs(self, requests: list) -> list[RequestOutput]:
        outputs = []
        for request in dict.fromkeys(requests):
            output = request.make_output()
            if output is not None:
                outputs.append(output)
            if request.finished:
                del self.requests[request.request_id]
        return outputs
