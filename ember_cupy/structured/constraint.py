"""One sequence's place in its grammar: an llguidance matcher fed with its output tokens.

The engine's hook is `Sequence.constraint` (None when unconstrained): the sampler asks it for the
token bitmask, then feeds it the sampled token; a sequence whose grammar is complete finishes
("stop"), one whose grammar failed (a limit of llguidance hit mid-way, e.g. too many parser items
in a row, or a token it refused) finishes with "error", without that token; forks (n > 1) call
`fork()`. `sync` keeps the matcher equal to the sequence's output
whatever happened to the sequence between steps (recompute after preemption keeps the output, so it
is a no-op there; an output that was cut back is rolled back, tokens appended without sampling
are consumed).
"""
from __future__ import annotations

import logging

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from ember_cupy.structured.messages import brief

logger = logging.getLogger("ember_cupy.structured")


class GrammarConstraint:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, consumed: list[int] | None = None):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.consumed: list[int] = list(consumed or [])   # the output tokens the matcher has taken
        self.failed = False                               # the grammar refused a token or hit a limit

    def fork(self) -> "GrammarConstraint":
        """An independent copy in the same state (n > 1: each child its own matcher)."""
        child = GrammarConstraint(self._matcher.deep_copy(), self.vocab_size, self.consumed)
        child.failed = self.failed
        return child

    @property
    def is_finished(self) -> bool:
        """The grammar is complete (nothing may follow) or broken: the sequence should stop."""
        return self.failed or self._matcher.is_stopped()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Allowed next tokens into bitmask[row] (int32 words, bit t % 32 of word t // 32)."""
        llg_numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Feed one sampled token; False (and the constraint has failed) if the grammar refused it:
        only possible when a row had no allowed token left (the matcher hit a limit computing the
        mask, or all logits were NaN)."""
        if self.failed:
            return False
        if not self._matcher.consume_token(int(token_id)):
            logger.warning("constrained output stopped with an error after %d tokens: %s", len(self.consumed),
                           brief(self._matcher.get_error() or f"token {token_id} is not allowed"))
            self.failed = True
            return False
        self.consumed.append(int(token_id))
        return True

    def sync(self, output_token_ids: list[int]) -> None:
        """Bring the matcher to exactly output_token_ids (see the module docstring)."""
        consumed = self.consumed
        if len(consumed) == len(output_token_ids) and (not consumed or consumed[-1] == output_token_ids[-1]):
            return
        common = 0
        for a, b in zip(consumed, output_token_ids):
            if a != b:
                break
            common += 1
        if common < len(consumed):
            self._matcher.rollback(len(consumed) - common)
            del consumed[common:]
            self.failed = self._matcher.is_error()
        for token in output_token_ids[common:]:
            if not self.accept(token):
                break
