"""Speculative decoding's part of a step: drafts before scheduling, verification after sampling.

Before the scheduler runs, propose() gives each decoding sequence that may speculate the drafts
its proposer offers (at most num_speculative_tokens, and never past its max_tokens), and the
gate (speculation_gate.py) keeps those that pay at this step's size. Proposers: prompt lookup
(ngram_proposer.py, which describes their interface) and a draft model (draft_proposer.py, whose
own step costs the gate weighs before it runs). The scheduler runs a
sequence's last token and its drafts as one chunk (Sequence.draft_token_ids); the runner gives a
logits row for each; the sampler samples every row as decoding would (Sequence.verification_view);
verify() keeps what spec_verify.py accepts; the scheduler rolls back the rest.

Never drafted for: a sequence under a grammar (structured outputs: its matcher would have to
take each draft and roll back the rejected ones; the simplest correct choice is none), a request
that opted out (SamplingParams.speculative), a sequence still in its prompt.

Random streams: a sampled (non-greedy) row draws one uniform from its sequence's stream, so a
verification of k drafts draws k + 1; settle_stream() rewinds the stream to where it would be
after the tokens actually emitted, so the next step draws what decoding one at a time would.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ember_cupy.engine.ngram_proposer import NgramProposer
from ember_cupy.engine.sequence import Sequence
from ember_cupy.engine.spec_verify import verified_tokens
from ember_cupy.engine.speculation_gate import Candidate, choose_drafts
from ember_cupy.engine.step_costs import StepCosts
from ember_cupy.engine_client import SpecDecodeCounts
from ember_cupy.speculative_config import SpeculativeConfig

PRIOR_ACCEPTANCE = 0.5     # a fresh estimate's start, before any verification
LEARNING_RATE = 0.25       # weight of each verified draft token in a sequence's estimate
GLOBAL_LEARNING_RATE = 0.02
# A sequence the gate leaves out learns nothing; each step it drifts this much toward the
# engine-wide estimate, so a low estimate stays low for a while, then gets tried again.
RECOVERY_RATE = 0.02


@dataclass
class SpecDecodeStats:
    """Cumulative counts, vLLM's spec_decode_* metrics."""
    num_speculative_tokens: int
    num_drafts: int = 0              # verifications (a sequence's drafts in one step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def counts(self) -> SpecDecodeCounts:
        """The counts now, frozen."""
        return SpecDecodeCounts(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                tuple(self.accepted_per_position))


class Speculator:
    def __init__(self, config: SpeculativeConfig, costs: StepCosts, proposer=None):
        self.config = config
        self.costs = costs
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        self.acceptance = PRIOR_ACCEPTANCE   # engine-wide, a fresh sequence's starting estimate
        self._drafted: list[Sequence] = []   # the sequences the proposer drafted for this step

    # --- before scheduling ----------------------------------------------------------------
    def propose(self, running: list[Sequence]) -> None:
        """Set the drafts of the decoding sequences of `running`."""
        decoding = [seq for seq in running if seq.num_uncomputed_tokens == 1]
        for seq in running:
            seq.draft_token_ids = []
        limit = self.config.disable_by_batch_size
        if not decoding or not self.costs.measured or (limit is not None and len(running) >= limit):
            return
        eligible = [seq for seq in decoding if self._may_draft(seq)]
        # a plan first, from each sequence's room: if no draft would pay, the proposer need not
        # run; a drafter that costs time (a draft model) drafts only what the plan keeps
        drafter_costs = self.proposer.costs
        bound = [Candidate(self._room(seq), self._acceptance(seq),
                           1 if drafter_costs is None else self.proposer.first_rows(seq)) for seq in eligible]
        plan = choose_drafts(bound, len(decoding), self.costs.seconds,
                             None if drafter_costs is None else drafter_costs.seconds)
        if not any(plan):
            return
        asked = [room.num_drafts if drafter_costs is None else count for room, count in zip(bound, plan)]
        asking = [(seq, count) for seq, count in zip(eligible, asked) if count]
        drafted = self.proposer.propose_batch([seq for seq, _ in asking], [count for _, count in asking])
        self._drafted = [seq for seq, _ in asking]
        offered = [(seq, drafts) for (seq, _), drafts in zip(asking, drafted) if drafts]
        if not offered:
            return
        candidates = [Candidate(len(drafts), self._acceptance(seq)) for seq, drafts in offered]
        kept = choose_drafts(candidates, len(decoding), self.costs.seconds)
        for (seq, drafts), count in zip(offered, kept):
            seq.draft_token_ids = drafts[:count]
            if count == 0:
                seq.draft_acceptance = self._acceptance(seq) + RECOVERY_RATE * (self.acceptance - self._acceptance(seq))

    def scheduled(self) -> None:
        """After scheduling: the proposer forgets the drafts that the gate or the scheduler (no
        room in the step or the KV pool) dropped."""
        for seq in self._drafted:
            self.proposer.keep(seq, len(seq.draft_token_ids))
        self._drafted = []

    @staticmethod
    def _may_draft(seq: Sequence) -> bool:
        return (seq.constraint is None and not seq.params.allowed_token_ids and not seq.params.bad_words_token_ids
                and seq.params.speculative and not seq.pooled)

    def _room(self, seq: Sequence) -> int:
        """Drafts seq may take: num_speculative_tokens, and never past its max_tokens."""
        return max(0, min(self.config.num_speculative_tokens, seq.max_tokens - seq.num_output_tokens - 1))

    def _acceptance(self, seq: Sequence) -> float:
        return self.acceptance if seq.draft_acceptance is None else seq.draft_acceptance

    # --- after sampling -------------------------------------------------------------------
    def verify(self, seq: Sequence, target: list[int]) -> list[int]:
        """The tokens seq emits: target[j] is what its row j sampled (after j drafts)."""
        drafts = seq.draft_token_ids
        tokens = verified_tokens(drafts, target)
        self.proposer.keep(seq, len(tokens) - 1)
        self.stats.observe(len(drafts), len(tokens) - 1)
        self._learn(seq, len(drafts), len(tokens) - 1)
        return tokens

    def _learn(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Each draft token the verification reached is one observation: accepted ones 1, the
        first rejected one 0 (those after it were never judged)."""
        estimate = self._acceptance(seq)
        observations = [1.0] * num_accepted + ([0.0] if num_accepted < num_drafts else [])
        for value in observations:
            estimate += LEARNING_RATE * (value - estimate)
            self.acceptance += GLOBAL_LEARNING_RATE * (value - self.acceptance)
        seq.draft_acceptance = estimate

    @staticmethod
    def hold_stream(seq: Sequence):
        """The random stream's state before a verification samples seq's rows (None: greedy)."""
        return None if seq.params.greedy else seq.generator().bit_generator.state

    @staticmethod
    def settle_stream(seq: Sequence, state, num_emitted: int) -> None:
        """Rewind seq's stream to `state`, then past the num_emitted draws actually used."""
        if state is None:
            return
        rng = seq.generator()
        rng.bit_generator.state = state
        for _ in range(num_emitted):
            rng.random()
