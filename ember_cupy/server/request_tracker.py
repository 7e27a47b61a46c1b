"""RequestTracker: one request's timing and token counts, for the Prometheus metrics (vLLM's
names, server/metrics.py) and the HTTP access log's usage (access_log.RequestUsage)."""
from __future__ import annotations

from ember_cupy.engine.pooling import PoolingParams
from ember_cupy.outputs import RequestOutput
from ember_cupy.sampling_params import SamplingParams
from ember_cupy.server.access_log import RequestUsage
from ember_cupy.server.metrics import EngineMetrics


class RequestTracker:
    __slots__ = ("arrival", "params", "usage", "metrics", "last_token", "prompt_counted", "generated",
                 "generated_by_index")

    def __init__(self, arrival: float, params: SamplingParams | PoolingParams, usage: RequestUsage | None,
                 metrics: EngineMetrics | None):
        self.arrival = arrival
        self.params = params
        self.usage = usage          # the HTTP request's token counts (access_log), if any
        self.metrics = metrics
        self.last_token: dict[int, float] = {}
        self.prompt_counted = False
        self.generated = 0
        self.generated_by_index: dict[int, int] = {}   # completion index -> its tokens (n > 1)

    def observe(self, output: RequestOutput, now: float) -> None:
        """Count one delta output of the request, received at `now`."""
        first = not self.prompt_counted
        self.prompt_counted = True
        if self.usage is not None:
            _count_usage(output, self.usage, first)
        if self.metrics:
            self._observe_metrics(output, now, first)

    def aborted(self) -> None:
        if self.metrics:
            self.metrics.request_finished("abort")

    def _observe_metrics(self, output: RequestOutput, now: float, first: bool) -> None:
        m = self.metrics
        if first:
            m.prompt_tokens.inc(len(output.prompt_token_ids))
        for completion in output.outputs:
            new = len(completion.delta_token_ids)
            if not new:
                continue
            self.generated += new
            self.generated_by_index[completion.index] = self.generated_by_index.get(completion.index, 0) + new
            m.generation_tokens.inc(new)
            last = self.last_token.get(completion.index)
            if last is None:
                if completion.index == 0:
                    m.time_to_first_token.observe(now - self.arrival)
                new -= 1
                last = self.arrival if completion.index == 0 else now
            if new > 0:
                for _ in range(new):
                    m.inter_token_latency.observe((now - last) / new)
            self.last_token[completion.index] = now
        if output.finished:
            self._observe_finished(output, now)

    def _observe_finished(self, output: RequestOutput, now: float) -> None:
        m = self.metrics
        m.e2e_request_latency.observe(now - self.arrival)
        if output.metrics is not None:
            m.request_timings(output.metrics)
        if isinstance(self.params, SamplingParams):
            m.request_params(self.params)
        m.request_prompt_tokens.observe(len(output.prompt_token_ids))
        m.request_generation_tokens.observe(self.generated)
        m.request_max_num_generation_tokens.observe(max(self.generated_by_index.values(), default=0))
        m.request_finished(_finish_reason(output, self.params))


def _count_usage(output: RequestOutput, usage: RequestUsage, first: bool) -> None:
    """Add an output's tokens to its HTTP request's counts (the prompt once, on its first output)."""
    if first:
        usage.prompt_tokens += len(output.prompt_token_ids)
    usage.completion_tokens += sum(len(c.delta_token_ids) for c in output.outputs)


def _finish_reason(output: RequestOutput, params) -> str | None:
    """The request's finish reason for the metrics: a pooling request ends as vLLM v1 ends one ("stop")."""
    if output.outputs:
        return output.outputs[0].finish_reason
    return "stop" if isinstance(params, PoolingParams) else None
