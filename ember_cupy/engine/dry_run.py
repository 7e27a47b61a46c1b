"""The scheduler and block manager driven without a model: for trace replay and property tests.

A "computed" token costs nothing; a sampled token is a deterministic function of the sequence so
far, so the same trace always yields the same schedule.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from ember_cupy.config import EngineConfig
from ember_cupy.engine.block_manager import BlockManager
from ember_cupy.engine.scheduler import ScheduledBatch, Scheduler
from ember_cupy.engine.sequence import Sequence, SequenceStats
from ember_cupy.sampling_params import SamplingParams


@dataclass
class TraceRequest:
    request_id: str
    arrival_step: int
    prompt_len: int
    max_tokens: int
    priority: int = 0
    prefix_id: int | None = None   # requests with the same prefix_id share their first tokens
    prefix_len: int = 0


@dataclass
class RequestTimeline:
    request_id: str
    arrival_step: int
    first_scheduled_step: int | None = None
    finished_step: int | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None


@dataclass
class DryRun:
    config: EngineConfig
    num_blocks: int
    vocab_size: int = 1000
    block_manager: BlockManager = field(init=False)
    scheduler: Scheduler = field(init=False)
    timelines: dict[str, RequestTimeline] = field(default_factory=dict)
    batches: list[ScheduledBatch] = field(default_factory=list)

    def __post_init__(self):
        self.block_manager = BlockManager(self.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self._seqs: dict[str, Sequence] = {}

    def add(self, request: TraceRequest) -> None:
        prompt = _prompt_tokens(request, self.vocab_size)
        seq = Sequence(request.request_id, prompt, SamplingParams(max_tokens=request.max_tokens),
                       request.max_tokens, priority=request.priority, stats=SequenceStats(0.0))
        self._seqs[request.request_id] = seq
        self.timelines[request.request_id] = RequestTimeline(request.request_id, self.scheduler.step_count)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            self.timelines[request_id].finish_reason = "abort"
            self.timelines[request_id].finished_step = self.scheduler.step_count

    def step(self) -> ScheduledBatch:
        batch = self.scheduler.schedule()
        self.batches.append(batch)
        step = self.scheduler.step_count
        for seq, num_tokens in batch.scheduled:
            timeline = self.timelines[seq.request_id]
            if timeline.first_scheduled_step is None:
                timeline.first_scheduled_step = step
                timeline.num_cached_tokens = seq.stats.num_cached_tokens
            seq.num_computed_tokens += num_tokens
            self.block_manager.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                self._sample(seq, step)
        return batch

    def _sample(self, seq: Sequence, step: int) -> None:
        seq.token_ids.append(_token(seq.request_id, seq.num_tokens) % self.vocab_size)
        if seq.num_output_tokens >= seq.max_tokens:
            self.scheduler.finish(seq, "length")
            timeline = self.timelines[seq.request_id]
            timeline.finished_step, timeline.finish_reason = step, "length"
            timeline.num_preemptions = seq.stats.num_preemptions
            del self._seqs[seq.request_id]

    @property
    def live_sequences(self) -> list[Sequence]:
        return list(self._seqs.values())

    def run(self, trace: list[TraceRequest], max_steps: int = 100_000) -> dict[str, RequestTimeline]:
        pending = sorted(trace, key=lambda r: r.arrival_step)
        while pending or self.scheduler.has_work():
            while pending and pending[0].arrival_step <= self.scheduler.step_count:
                self.add(pending.pop(0))
            self.step()
            if self.scheduler.step_count >= max_steps:
                raise RuntimeError(f"trace did not finish within {max_steps} steps")
        return self.timelines


def _prompt_tokens(request: TraceRequest, vocab_size: int) -> list[int]:
    shared = min(request.prefix_len, request.prompt_len) if request.prefix_id is not None else 0
    prefix = [_token("prefix", request.prefix_id, i) % vocab_size for i in range(shared)]
    own = [_token(request.request_id, i) % vocab_size for i in range(request.prompt_len - shared)]
    return prefix + own


def _token(*parts) -> int:
    """A deterministic pseudo-random token (Python's str hash changes between processes)."""
    return zlib.crc32(repr(parts).encode())
