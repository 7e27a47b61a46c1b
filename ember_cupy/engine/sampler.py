"""Logits -> next tokens for a batch of sequences, vectorised over the batch where it pays.

Order of processing, as vLLM v1's sampler:

0. Structured decoding: a sequence with a constraint (Sequence.constraint, ember_cupy/structured/)
   has every token its grammar does not allow next set to -inf (on the device under CuPy), before
   anything below except the logprobs; the sampled token is then fed to its matcher.
1. Logprobs are the RAW model logprobs (vLLM's default ``logprobs_mode="raw_logprobs"``): the
   log-softmax of the logits before the grammar mask, min_tokens, logit_bias, penalties and
   temperature. A token
   forced by logit_bias reports its model logprob, not 0.0; the top logprobs are the raw top.
2. min_tokens: EOS and stop tokens go to -inf while fewer than min_tokens tokens were generated.
3. logit_bias is added.
4. Penalties: repetition (every token of the prompt and the output: positive logits divided by
   the penalty, the others multiplied), then frequency (times the count in the output) and
   presence (once per distinct output token). Built for the whole batch at once.
5. Greedy rows (temperature < 1e-5, or top_k == 1) take the argmax.
6. The other rows are divided by their temperature, then filtered:
   min_p drops a token whose probability is below min_p times the largest one; top-k keeps every
   token whose logit is >= the k-th largest (ties at the boundary all stay, as vLLM's mask
   ``logits < kth``); top-p is applied to the distribution renormalised over what min_p and top-k
   left (min_p and top-k commute; vLLM applies min_p, then top-k, then top-p): walking the tokens
   by decreasing probability, a token stays while the mass strictly before it is below top_p, so
   the top token always stays. Among equal logits that walk takes the lower token id first.
7. One uniform per row from the sequence's own generator, inverted over the kept tokens' CDF
   (tokens by decreasing probability when a filter sorted them, else by id): a seeded request
   gets the same tokens whatever else shares its batch.

No full-vocabulary sort: top-k is a partition (one for the whole batch) and a sort of the k
survivors; top-p alone sorts only the tokens above a partition threshold of 256, 2048 or 16384
candidates, the first set whose mass reaches top_p (it then holds every token top-p keeps), and
sorts the whole vocabulary only when none does.

Non-finite logits: NaN counts as -inf, so it is never sampled while anything else can be. A row
with +inf logits has the limit distribution: uniform over its +inf tokens (the filters still
apply). A row left with no finite or +inf logit after processing (all NaN / -inf) has no
distribution; it falls back to greedy, the argmax of the processed row, which is token 0 when
every value is -inf, the same token a temperature-0 request gets. Logprobs follow the same rules:
a +inf row gives log(1/n) to each of its n +inf tokens and -inf to the rest, a row without any
finite or +inf value gives -inf everywhere.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from itertools import chain

import numpy as np

from ember_cupy.engine.sequence import Sequence
from ember_cupy.ops import _host
from ember_cupy.structured.bitmask import apply_token_bitmask, apply_token_bitmask_numpy, fill_bitmasks

_host.register_signature("ember_kth_largest", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int)

# Candidate set sizes tried, in turn, for a top-p without top-k before sorting the whole vocabulary.
TOP_P_CANDIDATES = (256, 2048, 16384)


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]   # (token id, logprob), best first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax; NaN counts as -inf (see the module docstring for +inf and empty rows)."""
    top = logits.max(axis=-1, keepdims=True)     # NaN or +inf anywhere in a row shows here
    if np.isfinite(top).all():
        shifted = logits - top
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    logits = np.where(np.isnan(logits), np.float32(-np.inf), logits)
    out = np.full(logits.shape, -np.inf, dtype=np.result_type(logits.dtype, np.float32))
    top = logits.max(axis=-1)
    finite = np.isfinite(top)
    if finite.any():
        out[finite] = log_softmax(logits[finite])
    infinite = top == np.inf
    if infinite.any():
        is_inf = logits[infinite] == np.inf
        count = is_inf.sum(axis=-1, keepdims=True)
        out[infinite] = np.where(is_inf, -np.log(count), -np.inf)
    return out


def top_logprobs(logprobs_row: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    top = np.argpartition(-logprobs_row, k - 1)[:k]
    top = top[np.argsort(-logprobs_row[top], kind="stable")]
    return [(int(i), float(logprobs_row[i])) for i in top]


def kth_largest(logits: np.ndarray, ks: list[int]) -> np.ndarray:
    """The ks[r]-th largest value of every row (the top-k thresholds): the host kernel
    (cpu/sampling.c, one heap pass per row) or its NumPy twin."""
    library = _host.active()
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    if library is None or not len(ks):
        return kth_largest_numpy(logits, ks)
    k = np.asarray(ks, dtype=np.int64)
    out = np.empty(len(ks), dtype=np.float32)
    status = library.lib.ember_kth_largest(logits.ctypes.data, logits.shape[0], logits.shape[1],
                                           logits.shape[1], k.ctypes.data, out.ctypes.data)
    if status:
        raise ValueError(f"kth_largest: k must be in [1, {logits.shape[1]}]")
    return out


def kth_largest_numpy(logits: np.ndarray, ks: list[int]) -> np.ndarray:
    vocab = logits.shape[-1]
    return np.array([np.partition(row, vocab - k)[vocab - k] for row, k in zip(logits, ks)], dtype=np.float32)


def _by_decreasing_logit(row: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids (increasing) ordered by decreasing logit, the lower id first among equals."""
    return ids[np.argsort(-row[ids], kind="stable")]


def _top_p_count(cumulative: np.ndarray, limit: float) -> int:
    """How many of the sorted tokens top-p keeps: token j stays while cumulative[j - 1] < limit."""
    return min(1 + int(np.searchsorted(cumulative, limit, side="left")), len(cumulative))


def filtered_distribution(row: np.ndarray, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                          kth: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The tokens one temperature-scaled row may sample and their unnormalised probabilities
    (float64), in the order the draw walks them. Empty when the row has no finite or +inf logit.

    kth, if given, is the row's k-th largest logit for k = top_k (or, without top-k but with
    top_p < 1, for k = TOP_P_CANDIDATES[0]); the batch computes it with one partition.
    """
    vocab = row.shape[-1]
    top = row.max()
    if top == np.inf:            # the limit of the softmax: uniform over the +inf tokens
        row = np.where(row == np.inf, np.float32(0.0), np.float32(-np.inf))
        top, kth = np.float32(0.0), None
    elif not np.isfinite(top):   # nothing finite left: no distribution
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
    min_p = np.float32(min_p)
    if 0 < top_k < vocab:
        if kth is None:
            kth = np.partition(row, vocab - top_k)[vocab - top_k]
        ids = _by_decreasing_logit(row, np.flatnonzero(row >= kth))
        probs = np.exp(row[ids] - top)
        if min_p > 0:
            keep = probs >= min_p
            ids, probs = ids[keep], probs[keep]
        probs = probs.astype(np.float64)
        if top_p < 1.0:
            n = _top_p_count(np.cumsum(probs), top_p * probs.sum())
            ids, probs = ids[:n], probs[:n]
        return ids, probs
    all_probs = np.exp(row - top)
    allowed = all_probs >= min_p if min_p > 0 else None
    if top_p >= 1.0:
        if allowed is None:
            return np.arange(vocab), all_probs.astype(np.float64)
        ids = np.flatnonzero(allowed)
        return ids, all_probs[ids].astype(np.float64)
    limit = top_p * (all_probs if allowed is None else all_probs[allowed]).sum(dtype=np.float64)
    for size in TOP_P_CANDIDATES + (vocab,):
        if size >= vocab:        # sort everything that is allowed
            ids = np.arange(vocab) if allowed is None else np.flatnonzero(allowed)
        else:
            threshold = kth if size == TOP_P_CANDIDATES[0] and kth is not None \
                else np.partition(row, vocab - size)[vocab - size]
            candidates = row >= threshold
            ids = np.flatnonzero(candidates if allowed is None else candidates & allowed)
        ids = _by_decreasing_logit(row, ids)
        probs = all_probs[ids].astype(np.float64)
        cumulative = np.cumsum(probs)
        # every token outside the candidates comes after them all, so if the candidates' mass
        # reaches the limit, top-p drops every other token
        if size >= vocab or cumulative[-1] >= limit:
            break
    n = _top_p_count(cumulative, limit)
    return ids[:n], probs[:n]


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits, seqs: list[Sequence]) -> SamplerOutput:
        output = self._sample_rows(logits, seqs)
        for seq, token in zip(seqs, output.token_ids):
            if seq.constraint is not None:
                seq.constraint.accept(token)
        return output

    def _sample_rows(self, logits, seqs: list[Sequence]) -> SamplerOutput:
        if not seqs:   # a step where nothing samples (mid-prefill): CuPy refuses argmax of (0, vocab)
            return SamplerOutput([], [])
        logprob_rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        grammar = self._grammar_masks(seqs, logits.shape[-1])
        raw = None   # the rows that report logprobs, before the grammar mask
        if not isinstance(logits, np.ndarray):  # on the device: copy back only what is needed
            if grammar is not None:
                if logprob_rows:
                    raw = logits[logprob_rows].astype(np.float32).get()   # a list indexes CuPy too
                logits = logits.astype(np.float32)          # a private copy: the mask writes -inf
                apply_token_bitmask(logits, *grammar)
                grammar = None
            if all(self._plain_greedy(seq) for seq in seqs):
                masked = logits.copy()
                masked[masked != masked] = -np.inf          # NaN never wins the argmax
                return SamplerOutput([int(t) for t in masked.argmax(axis=-1).get()], [None] * len(seqs))
            logits = logits.astype(np.float32).get()
        logits = np.array(logits, dtype=np.float32)   # a private host copy we may modify
        if np.isnan(logits.max(axis=-1)).any():
            logits[np.isnan(logits)] = -np.inf
        if logprob_rows:
            raw = logits[logprob_rows] if raw is None else np.where(np.isnan(raw), np.float32(-np.inf), raw)
        logprobs = log_softmax(raw) if logprob_rows else None   # raw, as vLLM
        if grammar is not None:
            apply_token_bitmask(logits, *grammar)
        self._process(logits, seqs)
        token_ids = np.argmax(logits, axis=-1)
        random_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if random_rows:
            token_ids[random_rows] = self._sample(logits[random_rows], [seqs[i] for i in random_rows])
        token_ids = [int(t) for t in token_ids]
        entries: list[TokenLogprobs | None] = [None] * len(seqs)
        for row, values in zip(logprob_rows, logprobs if logprobs is not None else []):
            token = token_ids[row]
            entries[row] = TokenLogprobs(token, float(values[token]), top_logprobs(values, seqs[row].params.logprobs))
        return SamplerOutput(token_ids=token_ids, logprobs=entries)

    @staticmethod
    def _grammar_masks(seqs: list[Sequence], vocab: int):
        """(bitmask, rows) of the constrained rows, or None: the mask goes on before everything
        else (min_tokens, bias, penalties, temperature); logprobs stay the raw model's."""
        rows = [i for i, seq in enumerate(seqs) if seq.constraint is not None]
        if not rows:
            return None
        for i in rows:
            seqs[i].constraint.sync(seqs[i].output_token_ids)
        return fill_bitmasks([seqs[i].constraint for i in rows], vocab), np.asarray(rows, dtype=np.int32)

    @staticmethod
    def _plain_greedy(seq: Sequence) -> bool:
        """Greedy with nothing that needs the whole row on the host."""
        p = seq.params
        return (p.greedy and p.logprobs is None and not p.logit_bias and p.repetition_penalty == 1.0
                and not p.presence_penalty and not p.frequency_penalty
                and seq.num_output_tokens >= p.min_tokens)

    # --- logits processing --------------------------------------------------------------
    def _process(self, logits: np.ndarray, seqs: list[Sequence]) -> None:
        """min_tokens, logit_bias, then the penalties, in place (vLLM's order)."""
        for row, seq in enumerate(seqs):
            params = seq.params
            if seq.num_output_tokens < params.min_tokens:
                banned = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
                logits[row, banned] = -np.inf
        biased = [(row, seq.params.logit_bias) for row, seq in enumerate(seqs) if seq.params.logit_bias]
        if biased:
            rows = np.repeat([row for row, _ in biased], [len(bias) for _, bias in biased])
            ids = np.fromiter(chain.from_iterable(bias.keys() for _, bias in biased), dtype=np.int64)
            values = np.fromiter(chain.from_iterable(bias.values() for _, bias in biased), dtype=np.float32)
            logits[rows, ids] += values
        self._apply_penalties(logits, seqs)

    @staticmethod
    def _apply_penalties(logits: np.ndarray, seqs: list[Sequence]) -> None:
        vocab = logits.shape[-1]
        rows = [i for i, seq in enumerate(seqs) if seq.params.repetition_penalty != 1.0]
        if rows:   # every distinct token of the prompt and the output, once
            lists = [seqs[i].token_ids for i in rows]
            seen = np.zeros((len(rows), vocab), dtype=bool)
            seen[np.repeat(np.arange(len(rows)), [len(t) for t in lists]),
                 np.fromiter(chain.from_iterable(lists), dtype=np.int64)] = True
            flat = np.flatnonzero(seen)
            local, ids = flat // vocab, flat % vocab
            where = (np.asarray(rows)[local], ids)
            penalty = np.array([seqs[i].params.repetition_penalty for i in rows], dtype=np.float32)[local]
            values = logits[where]
            logits[where] = np.where(values > 0, values / penalty, values * penalty)
        rows = [i for i, seq in enumerate(seqs)
                if (seq.params.presence_penalty or seq.params.frequency_penalty) and seq.num_output_tokens]
        if rows:   # distinct output tokens and their counts, for the batch at once
            outputs = [seqs[i].output_token_ids for i in rows]
            flat = (np.repeat(np.arange(len(rows)) * vocab, [len(t) for t in outputs])
                    + np.fromiter(chain.from_iterable(outputs), dtype=np.int64))
            flat, counts = np.unique(flat, return_counts=True)
            local, ids = flat // vocab, flat % vocab
            frequency = np.array([seqs[i].params.frequency_penalty for i in rows], dtype=np.float64)[local]
            presence = np.array([seqs[i].params.presence_penalty for i in rows], dtype=np.float64)[local]
            logits[np.asarray(rows)[local], ids] -= frequency * counts + presence

    # --- random sampling ----------------------------------------------------------------
    def _sample(self, logits: np.ndarray, seqs: list[Sequence]) -> np.ndarray:
        temperature = np.array([seq.params.temperature for seq in seqs], dtype=np.float32)
        logits /= temperature[:, None]
        vocab = logits.shape[-1]
        top_k = [seq.params.top_k if 0 < seq.params.top_k < vocab else 0 for seq in seqs]
        # the k-th largest logit of every row that needs one, from a single partition
        wanted = [k or (TOP_P_CANDIDATES[0] if seq.params.top_p < 1.0 else 0) for k, seq in zip(top_k, seqs)]
        need = [i for i, k in enumerate(wanted) if 0 < k < vocab]
        kth: list[float | None] = [None] * len(seqs)
        if need:
            for i, value in zip(need, kth_largest(logits[need], [wanted[i] for i in need])):
                kth[i] = value
        chosen = np.empty(len(seqs), dtype=np.int64)
        for i, seq in enumerate(seqs):
            ids, probs = filtered_distribution(logits[i], top_k[i], seq.params.top_p, seq.params.min_p, kth[i])
            uniform = self._rng(seq).random()   # drawn even for an empty row: the stream stays aligned
            if not len(ids):
                chosen[i] = int(np.argmax(logits[i]))   # no distribution: greedy (module docstring)
                continue
            cumulative = np.cumsum(probs)
            pick = np.searchsorted(cumulative, uniform * cumulative[-1], side="right")
            chosen[i] = ids[min(int(pick), len(ids) - 1)]
        return chosen

    @staticmethod
    def _rng(seq: Sequence) -> np.random.Generator:
        if seq.rng is None:
            seed = seq.params.seed
            seq.rng = np.random.default_rng(None if seed is None else [seed % 2**64, seq.index])
        return seq.rng
