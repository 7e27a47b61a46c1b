"""Which drafted tokens the target model keeps: speculative sampling (Leviathan, Kalman and
Matias, "Fast Inference from Transformers via Speculative Decoding", 2023, section 2.3).

The rule, for a draft token d that the drafter proposed with probability q(d), and the target's
distribution p at that position: accept d with probability min(1, p(d) / q(d)); at the first
rejection emit a token from the residual distribution norm(max(0, p - q)) and stop; when all
drafts are accepted, emit one more token from the target's next distribution (the bonus token).
The output then follows p exactly, whatever q is.

The drafters here are deterministic (prompt lookup; a draft model decoding greedily), so q is
one-hot on d: accept d with probability p(d); on rejection emit a token of p with d removed,
renormalised (max(0, p - q) is p without d). Drawing x ~ p and accepting d iff x == d is that
rule: P(x == d) = p(d), and given x != d, x has probability p(x) / (1 - p(d)), the residual.
The engine draws x as decoding without speculation would: the target's processed distribution
at that position (penalties and min_tokens seeing the drafts before it) and the uniform the
sequence's random stream gives that position. So a verification emits, bit for bit, the tokens
that one-at-a-time decoding would (greedy is the argmax; a seeded request draws the same
numbers), not only tokens of the same distribution.
"""
from __future__ import annotations


def accepted_count(draft: list[int], target: list[int]) -> int:
    """How many leading drafts the target keeps: target[j] is the token the target sampled
    after the first j drafts (len(target) == len(draft) + 1)."""
    count = 0
    for drafted, sampled in zip(draft, target):
        if drafted != sampled:
            break
        count += 1
    return count


def verified_tokens(draft: list[int], target: list[int]) -> list[int]:
    """The tokens a verification emits: the accepted drafts, then the target's token after them
    (its correction at the first rejection, or the bonus token when every draft was kept)."""
    return list(target[:accepted_count(draft, target) + 1])
