"""The logprob entries of a step's prompt positions (SamplingParams.prompt_logprobs), all rows at once.

A step can score hundreds of prompt positions over the whole vocabulary; a NumPy partition per row
cost about 1 ms each. Here the k-th largest logprob of every row comes from one host-kernel call
(sampler.kth_largest) and the rows whose top k is unambiguous (exactly k values at or above it) are
gathered and sorted together. Rows with a tie at the k-th place keep the per-row rule
(sampler.top_logprobs), so every entry is the one the per-row path gives, bit for bit.
"""
from __future__ import annotations

import numpy as np

from ember_cupy.engine.sampler import kth_largest, log_softmax, top_logprobs
from ember_cupy.engine.token_logprobs import TokenLogprobs


def prompt_logprob_entries(logits: np.ndarray, target_ids: list[int], k: int) -> list[TokenLogprobs]:
    """Entry r: the logprob of target_ids[r] under logits row r and the row's k best tokens."""
    logprobs = log_softmax(np.asarray(logits, dtype=np.float32))
    chosen = logprobs[np.arange(len(target_ids)), np.asarray(target_ids, dtype=np.int64)].tolist()
    tops = top_logprobs_rows(logprobs, k)
    return [TokenLogprobs(token, value, top) for token, value, top in zip(target_ids, chosen, tops)]


def top_logprobs_rows(logprobs: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    """top_logprobs(row, k) of every row of a [rows, vocab] float32 matrix."""
    rows, vocab = logprobs.shape
    k = min(k, vocab)
    if k <= 0 or rows == 0:
        return [[] for _ in range(rows)]
    kth = kth_largest(logprobs, [k] * rows)
    at_least = logprobs >= kth[:, None]
    exact = np.flatnonzero(at_least.sum(axis=1) == k)
    tops: list = [None] * rows
    if len(exact):
        mask = at_least if len(exact) == rows else at_least[exact]
        ids = np.nonzero(mask)[1].reshape(len(exact), k)                 # increasing ids per row
        values = logprobs[exact[:, None], ids]
        order = np.argsort(-values, axis=1, kind="stable")               # the lower id first among equals
        ids, values = np.take_along_axis(ids, order, axis=1), np.take_along_axis(values, order, axis=1)
        for row, row_ids, row_values in zip(exact.tolist(), ids.tolist(), values.tolist()):
            tops[row] = list(zip(row_ids, row_values))
    for row in range(rows):
        if tops[row] is None:                                            # a tie at the k-th place
            tops[row] = top_logprobs(logprobs[row], k)
    return tops
