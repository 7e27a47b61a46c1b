"""Whether drafts pay this step, and which: the choice that maximises the expected tokens emitted
per second, from measured step costs (engine/step_costs.py) and each sequence's acceptance.

A step of B decodes takes T(B) and emits B tokens. A draft token that rides along costs its row:
with D of them the step takes T(B + D). The i-th draft of a sequence (i from 1) is emitted only if
it and every one before it are accepted: with a per-token acceptance a, probability a**i (the
geometric model of Leviathan et al.). Each draft token is thus a unit worth a**i expected tokens;
units are taken best first (within a sequence that is its first draft first) and the prefix with
the best rate (B + sum of their worth) / T(B + D) is kept, when it beats B / T(B) by MIN_GAIN at
least.

A step that also computes prompt tokens is weighed as its decodes alone: it is long whatever it
drafts, and weighed against its own length any draft would look cheap, while its tokens are worth
what decoding them costs, T(B) / B each (a server drafted at a loss beside prefills). What a draft
row adds beside prompt rows is at most what it adds beside decodes, where a step's cost per row
is highest.

So speculation switches off when the batch is large enough that rows stop being free (T grows in
proportion), and a sequence whose acceptance stays low stops drafting (its units are worth
little), without a threshold to tune for either.

A drafter that costs time (a draft model: engine/draft_proposer.py) adds its own measured cost:
its i-th draft of every sequence comes from one draft step over the sequences drafting that many,
so with m_i units at position i the drafting takes the sum of S(m_i) over the positions, S the
draft model's measured step time, added to the time the drafts add to the step. The first
of those steps also computes what the drafter lacks of each sequence it drafts for (the tokens the
target emitted since its last drafts: one at least, more after steps that did not draft), so a
sequence's rows there are its lag, not 1. A sequence's first catch-up of its prompt is not charged:
it is paid once, for all its steps.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MIN_GAIN = 1.02   # a 2% better rate at least: a tie in measured costs is noise, not a reason


@dataclass
class Candidate:
    num_drafts: int      # tokens its proposer offers
    acceptance: float    # estimated probability that a draft token is accepted, given the ones before
    first_rows: int = 1  # rows of the drafter's first step for it (its lag behind the sequence)


def choose_drafts(candidates: list[Candidate], num_decodes: int, step_seconds: Callable[[int], float],
                  draft_seconds: Callable[[int], float] | None = None) -> list[int]:
    """How many of its drafts each candidate keeps (0: none). num_decodes: the step's decoding
    sequences; step_seconds(n): the time of a step of n tokens; draft_seconds(m): the time of a
    drafter's step for m sequences (None: drafting is free)."""
    units = sorted(((c.acceptance ** (i + 1), i, index) for index, c in enumerate(candidates)
                    for i in range(c.num_drafts)), key=lambda u: (-u[0], u[1], u[2]))
    best = MIN_GAIN * num_decodes / step_seconds(num_decodes)
    best_count, worth, drafting = 0, 0.0, 0.0
    per_position = [0] * max((c.num_drafts for c in candidates), default=0)
    for count, (value, position, index) in enumerate(units, 1):
        if value <= 0:
            break
        worth += value
        if draft_seconds is not None:
            rows = per_position[position]
            added = candidates[index].first_rows if position == 0 else 1
            drafting += draft_seconds(rows + added) - (draft_seconds(rows) if rows else 0.0)
            per_position[position] = rows + added
        rate = (num_decodes + worth) / (step_seconds(num_decodes + count) + drafting)
        if rate > best:
            best, best_count = rate, count
    kept = [0] * len(candidates)
    for _, _, index in units[:best_count]:
        kept[index] += 1
    return kept
