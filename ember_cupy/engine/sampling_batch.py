"""One step's sampling work as arrays: per-row parameters, the uniforms of the random rows, the
sparse logit edits (min_tokens and bad_words bans, logit_bias, penalties) and the rows that report logprobs.

Built on the host from the sequences, once a step; the host path reads it as it is and the device
path uploads it in one copy (`pack`). The layouts are those cuda/sampling.cu reads:
- ints [rows, 2]: top_k (0: none), greedy (0 / 1);
- reals [rows, 8] float64: temperature, top_p, min_p, uniform, repetition, frequency and presence
  penalties, unused;
- edits, CSR over the rows: offsets [rows + 1] and entries [n, 4] int32 = token, flags, count,
  bias (float32 bits); flags 1 logit_bias, 2 banned (min_tokens, bad_words), 4 repeated (in the prompt or
  the output of a row with a repetition penalty); count: the token's count in the output of a row
  with a frequency or presence penalty (0 otherwise). One entry per (row, token), rows in order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from ember_cupy.engine.sequence import Sequence

ROW_INTS, ROW_REALS = 2, 8
TEMPERATURE, TOP_P, MIN_P, UNIFORM, REPETITION, FREQUENCY, PRESENCE = range(7)
BIAS, BANNED, REPEATED = 1, 2, 4
# logit_edits sorts (key, kind) codes in one go (np.unique took ~7 ms for a batch of 16 with 1k-token
# penalty windows under NumPy 2.4, and searchsorted of unsorted keys as long again; the sort ~0.5 ms)
_KINDS, _COUNTED = 4, 3
_FLAG_OF_KIND = np.array([BANNED, BIAS, REPEATED, 0], dtype=np.int32)   # banned, biased, repeated, counted


@dataclass
class SamplingBatch:
    ints: np.ndarray            # [rows, ROW_INTS] int32
    reals: np.ndarray           # [rows, ROW_REALS] float64
    offsets: np.ndarray         # [rows + 1] int32
    entries: np.ndarray         # [n, 4] int32
    logprob_rows: np.ndarray    # [r] int32: the rows that report logprobs
    logprob_counts: list[int]   # how many top logprobs each of them wants
    vocab_size: int
    device_views: tuple | None = field(default=None, repr=False, compare=False)   # (xp, views), device_sampler's

    @property
    def num_rows(self) -> int:
        return len(self.ints)

    @property
    def greedy(self) -> np.ndarray:
        return self.ints[:, 1] != 0

    @property
    def has_edits(self) -> bool:
        return len(self.entries) > 0

    def pack(self) -> tuple[np.ndarray, dict[str, tuple[int, int, np.dtype, tuple]]]:
        """Every array in one byte buffer (8-byte aligned sections) and where each lies:
        name -> (byte offset, byte size, dtype, shape)."""
        parts = {"reals": self.reals, "ints": self.ints, "offsets": self.offsets, "entries": self.entries,
                 "logprob_rows": self.logprob_rows}
        layout, offset = {}, 0
        for name, array in parts.items():
            layout[name] = (offset, array.nbytes, array.dtype, array.shape)
            offset += -(-array.nbytes // 8) * 8
        buffer = np.zeros(max(offset, 8), dtype=np.uint8)
        for name, array in parts.items():
            start, size, _, _ = layout[name]
            buffer[start:start + size] = np.ascontiguousarray(array).view(np.uint8).ravel()
        return buffer, layout


def build_batch(seqs: list[Sequence], vocab: int, eos_token_ids: list[int], uniforms: np.ndarray) -> SamplingBatch:
    """The batch of `seqs` (one row each); uniforms[i] is row i's draw (ignored for greedy rows)."""
    ints = np.zeros((len(seqs), ROW_INTS), dtype=np.int32)
    reals = np.zeros((len(seqs), ROW_REALS), dtype=np.float64)
    for i, seq in enumerate(seqs):
        p = seq.params
        ints[i] = (p.top_k if 0 < p.top_k < vocab else 0, p.greedy)
        reals[i, :7] = (p.temperature, p.top_p, p.min_p, uniforms[i], p.repetition_penalty,
                        p.frequency_penalty, p.presence_penalty)
    offsets, entries = logit_edits(seqs, vocab, eos_token_ids)
    rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    return SamplingBatch(ints, reals, offsets, entries, np.asarray(rows, dtype=np.int32),
                         [seqs[i].params.logprobs for i in rows], vocab)


def logit_edits(seqs: list[Sequence], vocab: int, eos_token_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, entries) of the sparse edits, for the whole batch at once."""
    if not any(_has_edits(s) for s in seqs):   # the common case: no NumPy work at all
        return np.zeros(len(seqs) + 1, dtype=np.int32), np.zeros((0, 4), dtype=np.int32)
    def banned_ids(s: Sequence):
        banned = bad_word_bans(s)
        if s.num_output_tokens < s.params.min_tokens:
            banned += list(s.params.stop_token_ids) + ([] if s.params.ignore_eos else eos_token_ids)
        return banned
    banned = _keys(seqs, vocab, banned_ids)
    biased = _keys(seqs, vocab, lambda s: s.params.logit_bias or ())
    repeated = _keys(seqs, vocab, lambda s: s.token_ids if s.params.repetition_penalty != 1.0 else ())
    counted = _keys(seqs, vocab, lambda s: s.output_token_ids
                    if s.params.presence_penalty or s.params.frequency_penalty else ())
    # one sort of (key, kind) codes gives the distinct keys, each key's flags and its count
    kinds = [banned, biased, repeated, counted]
    codes = np.sort(np.concatenate([keys * _KINDS + kind for kind, keys in enumerate(kinds)]))
    if not len(codes):
        return np.zeros(len(seqs) + 1, dtype=np.int32), np.zeros((0, 4), dtype=np.int32)
    key, kind = codes // _KINDS, codes % _KINDS
    starts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    keys = key[starts]
    entries = np.zeros((len(keys), 4), dtype=np.int32)
    entries[:, 0] = keys % vocab
    entries[:, 1] = np.bitwise_or.reduceat(_FLAG_OF_KIND[kind], starts)
    entries[:, 2] = np.add.reduceat((kind == _COUNTED).astype(np.int32), starts)
    bias = np.fromiter(chain.from_iterable((s.params.logit_bias or {}).values() for s in seqs), dtype=np.float32)
    entries[np.searchsorted(keys, biased), 3] = bias.view(np.int32)   # a row's biased tokens are distinct
    offsets = np.searchsorted(keys // vocab, np.arange(len(seqs) + 1)).astype(np.int32)
    return offsets, entries


def bad_word_bans(s: Sequence) -> list[int]:
    """The last token of every bad word whose other tokens end the output (one-token words: always)."""
    output = s.output_token_ids
    return [ids[-1] for ids in s.params.bad_words_token_ids
            if len(ids) == 1 or (len(output) >= len(ids) - 1 and tuple(output[len(output) + 1 - len(ids):]) == ids[:-1])]


def _has_edits(s: Sequence) -> bool:
    p = s.params
    return bool(s.num_output_tokens < p.min_tokens or p.logit_bias or p.repetition_penalty != 1.0
                or p.bad_words_token_ids or ((p.presence_penalty or p.frequency_penalty) and s.num_output_tokens))


def _keys(seqs: list[Sequence], vocab: int, tokens_of) -> np.ndarray:
    """row * vocab + token for every token tokens_of(seq) names, in row order (repeats kept)."""
    lists = [tokens_of(seq) for seq in seqs]
    rows = np.repeat(np.arange(len(seqs), dtype=np.int64), [len(t) for t in lists])
    return rows * vocab + np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=len(rows))
