"""Request traces through the real scheduler and block manager, with a stand-in for the model:
for trace replay (tools/replay_trace.py) and the property tests.

Only the model is faked: a step's forward pass costs nothing and a sampled token is a
deterministic function of the sequence so far, so the same trace always gives the same
schedule. Everything else (scheduling, forks, preemption, prefix caching, the post-step
update and finishing) is the code LLMEngine runs.
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
    n: int = 1                     # sequences sampled from the prompt


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
class TraceReplay:
    config: EngineConfig
    num_blocks: int
    vocab_size: int = 1000
    eos_token_ids: tuple[int, ...] = ()
    block_manager: BlockManager = field(init=False)
    scheduler: Scheduler = field(init=False)
    timelines: dict[str, RequestTimeline] = field(default_factory=dict)
    batches: list[ScheduledBatch] = field(default_factory=list)

    def __post_init__(self):
        self.block_manager = BlockManager(self.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager, self.eos_token_ids)
        self._seqs: dict[str, list[Sequence]] = {}   # unfinished requests' sequences

    def add(self, request: TraceRequest) -> None:
        prompt = _prompt_tokens(request, self.vocab_size)
        params = SamplingParams(max_tokens=request.max_tokens, n=request.n)
        seq = Sequence(request.request_id, prompt, params, request.max_tokens, priority=request.priority,
                       stats=SequenceStats(0.0), num_pending_forks=request.n - 1)
        self._seqs[request.request_id] = [seq]
        self.timelines[request.request_id] = RequestTimeline(request.request_id, self.scheduler.step_count)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        seqs = self._seqs.get(request_id)
        if seqs is None:
            return
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self._close(request_id, "abort")

    def step(self) -> ScheduledBatch:
        batch = self.scheduler.schedule()
        self.batches.append(batch)
        step = self.scheduler.step_count
        for seq, _ in batch.scheduled:
            timeline = self.timelines[seq.request_id]
            if timeline.first_scheduled_step is None:
                timeline.first_scheduled_step = step
                timeline.num_cached_tokens = seq.stats.num_cached_tokens
        for child in batch.forked:
            self._seqs[child.request_id].append(child)
        tokens = [_token(seq.request_id, seq.index, seq.num_tokens) % self.vocab_size for seq, _ in batch.samples]
        touched = {seq.request_id for seq, _ in self.scheduler.update(batch, tokens)}
        for request_id in touched:
            seqs = self._seqs[request_id]
            if all(seq.is_finished for seq in seqs):
                self._close(request_id, seqs[0].finish_reason)
        return batch

    def _close(self, request_id: str, reason: str) -> None:
        seqs = self._seqs.pop(request_id)
        timeline = self.timelines[request_id]
        timeline.finished_step, timeline.finish_reason = self.scheduler.step_count, reason
        timeline.num_preemptions = sum(seq.stats.num_preemptions for seq in seqs)

    @property
    def live_sequences(self) -> list[Sequence]:
        return [seq for seqs in self._seqs.values() for seq in seqs if not seq.is_finished]

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
