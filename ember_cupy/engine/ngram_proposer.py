"""Prompt-lookup drafts (vLLM's "ngram" method): the tokens that followed an earlier occurrence of
the sequence's last n tokens, in its prompt or its output.

The longest n in [prompt_lookup_min, prompt_lookup_max] whose last-n-gram occurs earlier wins; of
its occurrences, the earliest (vLLM's choice); up to num_speculative_tokens of the tokens that
follow it, fewer when the context ends first. No occurrence: no draft.

Each sequence keeps an index of the earliest start of each of its n-grams, extended by the tokens
it gained since its last lookup, so a lookup costs O(new tokens), not a scan of the whole
context (a NumPy scan took ~60 us for 200 tokens and ~0.4 ms for 4,000, per sequence and step,
which the gate does not weigh). The index holds ~3 entries a token (~0.4 KB), freed with the
sequence.

The proposer interface (engine/speculator.py, and engine/draft_proposer.py's draft model):
propose_batch(seqs, max_tokens) -> each sequence's drafts; costs: the drafter's measured step
costs (StepCosts), None when drafting is free as here; first_rows(seq), where costs are given:
the rows the drafter's first step computes for seq; keep(seq, num_drafts): seq keeps only its
first num_drafts drafts (the rest were not scheduled, or rejected); release(seq): forget a
sequence (finished, aborted, preempted).
"""
from __future__ import annotations

import weakref


class NgramIndex:
    """The earliest start of every n-gram (min_n <= n <= max_n) of a growing token list."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.first_start: dict[tuple[int, ...], int] = {}
        self.indexed = 0          # n-grams ending before this position are in
        self.last_token = None    # token_ids[indexed - 1] when indexed: a cheap check of the prefix

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """At most max_tokens drafted tokens to follow token_ids (this index's list, grown since)."""
        total = len(token_ids)
        if max_tokens <= 0 or total <= self.min_n:
            return []
        self._catch_up(token_ids)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = self.first_start.get(tuple(token_ids[total - n:]))
            if start is not None and start < total - n:   # an occurrence before the suffix itself
                return token_ids[start + n:start + n + max_tokens]
        return []

    def _catch_up(self, token_ids: list[int]) -> None:
        total = len(token_ids)
        if total < self.indexed or (self.indexed and token_ids[self.indexed - 1] != self.last_token):
            self.first_start.clear()   # the list was cut (a stop string): index it afresh
            self.indexed = 0
        first_start = self.first_start
        for end in range(self.indexed, total):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                first_start.setdefault(tuple(token_ids[end + 1 - n:end + 1]), end + 1 - n)
        self.indexed = total
        self.last_token = token_ids[-1]


class NgramProposer:
    costs = None   # a lookup costs a few microseconds a sequence: nothing the gate must weigh

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        # sequence -> its index, dropped with the sequence if release() is never called
        self._indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def propose_batch(self, seqs, max_tokens: list[int]) -> list[list[int]]:
        return [self._index(seq).propose(seq.token_ids, limit) for seq, limit in zip(seqs, max_tokens)]

    def keep(self, seq, num_drafts: int) -> None:
        """Drafts are never indexed (only the sequence's own tokens): nothing to forget."""

    def release(self, seq) -> None:
        self._indexes.pop(seq, None)

    def _index(self, seq) -> NgramIndex:
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = NgramIndex(self.min_n, self.max_n)
        return index
