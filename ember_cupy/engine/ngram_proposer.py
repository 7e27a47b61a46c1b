"""Prompt-lookup drafts (vLLM's "ngram" method): the tokens that followed an earlier occurrence of
the sequence's last n tokens, in its prompt or its output.

The longest n in [prompt_lookup_min, prompt_lookup_max] whose last-n-gram occurs earlier wins; of
its occurrences, the earliest (vLLM's choice); up to num_speculative_tokens of the tokens that
follow it, fewer when the context ends first. No occurrence: no draft.

The proposer interface (engine/speculator.py, and engine/draft_proposer.py's draft model):
propose_batch(seqs, max_tokens) -> each sequence's drafts; costs: the drafter's measured step
costs (StepCosts), None when drafting is free as here; keep(seq, num_drafts): seq keeps only its
first num_drafts drafts (the rest were not scheduled, or rejected); release(seq): forget a
sequence (finished, aborted, preempted).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    costs = None   # a lookup costs ~0.1 ms a sequence: nothing the gate must weigh

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_batch(self, seqs, max_tokens: list[int]) -> list[list[int]]:
        return [self.propose(seq.token_ids, limit) for seq, limit in zip(seqs, max_tokens)]

    def keep(self, seq, num_drafts: int) -> None:
        """Nothing is kept per sequence: nothing to forget."""

    def release(self, seq) -> None:
        """Nothing is kept per sequence: nothing to free."""

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """At most max_tokens drafted tokens to follow token_ids."""
        total = len(token_ids)
        if max_tokens <= 0 or total <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # windows starting at 0 .. total - n - 1: every occurrence but the suffix itself
            windows = sliding_window_view(tokens[:total - 1], n)
            hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
            if len(hits):
                start = int(hits[0]) + n
                return tokens[start:start + max_tokens].tolist()
        return []
