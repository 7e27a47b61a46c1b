"""One generated sequence: its tokens, its KV block table, and how far it has been computed."""
from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

import numpy as np

from ember_cupy.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SequenceStats:
    """Raw timings and counts of one sequence, for outputs and metrics."""

    arrival_time: float
    arrival_step: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time


def merge_stats(stats: list[SequenceStats]) -> SequenceStats:
    """The stats of a request from those of its n sequences: the earliest start and first token,
    the latest last token and finish (None until all finished), preemptions summed; the cached
    prompt tokens are the first sequence's (the others fork from its prompt)."""
    def earliest(values):
        values = [v for v in values if v is not None]
        return min(values) if values else None
    finished = [s.finished_time for s in stats]
    return SequenceStats(
        arrival_time=min(s.arrival_time for s in stats),
        arrival_step=min(s.arrival_step for s in stats),
        first_scheduled_time=earliest(s.first_scheduled_time for s in stats),
        first_token_time=earliest(s.first_token_time for s in stats),
        last_token_time=max((s.last_token_time for s in stats if s.last_token_time is not None), default=None),
        finished_time=None if None in finished else max(finished),
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_cached_tokens=stats[0].num_cached_tokens)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                     # resolved: never None here
    index: int = 0                      # which of the request's n samples
    priority: int = 0
    cache_salt: str | None = None
    # the prompt's place among those of one client request (a batch of prompts or embedding
    # inputs): fcfs and priority start every request's first prompt before any request's second
    prompt_index: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)   # chain digests of its full computed blocks
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None    # "stop" | "length" | "abort" | "error" (its grammar failed)
    stop_reason: str | int | None = None
    rng: np.random.Generator | None = None
    stats: SequenceStats = field(default_factory=lambda: SequenceStats(arrival_time=time.monotonic()))
    # n > 1: the siblings this sequence (index 0) forks when its prompt is computed
    # (Scheduler._fork); until then they hold sequence slots (max_num_seqs) in its name.
    num_pending_forks: int = 0
    # Structured decoding: the sequence's constraint state (e.g. a grammar matcher), None when
    # unconstrained. It must have fork() -> an independent deep copy, called when the sequence
    # forks. Preemption keeps a sequence's tokens (recompute), so its constraint stays valid.
    constraint: object | None = None
    # An embedding request's sequence (ember_cupy/engine/pooling.py): prefill only; the row of
    # its last prompt token is pooled instead of sampled, and it finishes there.
    pooled: bool = False
    # Speculative decoding: the tokens drafted to follow token_ids, verified by this step's
    # forward pass (scheduled after the last token; never in token_ids until accepted), and the
    # running estimate of how often its drafted tokens are accepted (engine/speculator.py).
    draft_token_ids: list[int] = field(default_factory=list)
    draft_acceptance: float | None = None

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    def fork(self, index: int) -> Sequence:
        """A sibling continuing from the same tokens, with its own index (so its own seeded
        generator), stats and constraint state; the caller shares the KV blocks."""
        child = Sequence(self.request_id, self.prompt_token_ids, self.params, self.max_tokens,
                         index=index, priority=self.priority, cache_salt=self.cache_salt,
                         prompt_index=self.prompt_index, token_ids=list(self.token_ids),
                         stats=dataclasses.replace(self.stats, num_preemptions=0))
        if self.constraint is not None:
            child.constraint = self.constraint.fork()
        return child

    def generator(self) -> np.random.Generator:
        """The random stream of its sampled tokens: seeded by (seed, index), so each of the n
        samples of a seeded request draws its own numbers whatever runs beside it."""
        if self.rng is None:
            seed = self.params.seed
            self.rng = np.random.default_rng(None if seed is None else [seed % 2**64, self.index])
        return self.rng

    def verification_view(self, num_accepted: int) -> Sequence:
        """The sequence as it would stand with its first num_accepted drafts accepted: what the
        sampler reads to sample the token after them (penalties, min_tokens and logit_bias see
        those tokens). It shares the random stream, so its draw is the one that token would get."""
        self.generator()
        return dataclasses.replace(self, token_ids=self.token_ids + self.draft_token_ids[:num_accepted],
                                   draft_token_ids=[], constraint=None)

    @property
    def tokens_with_drafts(self) -> int:
        """Tokens a step may compute up to: token_ids and the drafts after them."""
        return len(self.token_ids) + len(self.draft_token_ids)

    def input_token_ids(self, num_tokens: int) -> list[int]:
        """The next num_tokens tokens to compute, drafts included."""
        start = self.num_computed_tokens
        tokens = self.token_ids[start:start + num_tokens]
        return tokens + self.draft_token_ids[:num_tokens - len(tokens)]

    @property
    def can_stop(self) -> bool:
        """Whether the newest token may end the sequence: min_tokens were generated before it."""
        return self.num_output_tokens > self.params.min_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens
