"""Logits -> next tokens for a batch of sequences, vectorised over the batch where it pays.

Order of processing, as vLLM v1's sampler:

0. Structured decoding: a sequence with a constraint (Sequence.constraint, ember_cupy/structured/)
   has every token its grammar does not allow next set to -inf (on the device under CuPy), before
   anything below except the logprobs; the sampled token is then fed to its matcher. Tokens
   outside SamplingParams.allowed_token_ids are masked the same way (structured/bitmask.py).
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

Where it runs: the same steps for NumPy and CuPy logits, each step a function with a NumPy twin
(below, the host path) and a kernel of cuda/sampling.cu (ember_cupy/engine/device_sampler.py, for
device arrays): apply_logit_edits (2-4), sample_tokens (5-7), raw_logprobs (1). A step's
parameters, uniforms and sparse edits are one SamplingBatch (sampling_batch.py), uploaded once;
on the device only token ids and the requested logprobs come back. The device walks the same
order with the same uniforms; where floating point decides between two neighbouring tokens it
may pick the other (device_sampler.py states the tolerance).

No full-vocabulary sort. Host: top-k is a partition (one for the whole batch) and a sort of the k
survivors; top-p alone sorts only the tokens above a partition threshold of 256, 2048 or 16384
candidates, the first set whose mass reaches top_p (it then holds every token top-p keeps), and
sorts the whole vocabulary only when none does. Device: radix descents over the row, one block a row.

Non-finite logits: NaN counts as -inf, so it is never sampled while anything else can be. A row
with +inf logits has the limit distribution: uniform over its +inf tokens (the filters still
apply). A row left with no finite or +inf logit after processing (all NaN / -inf) has no
distribution; it falls back to greedy, the argmax of the processed row, which is token 0 when
every value is -inf, the same token a temperature-0 request gets. Logprobs follow the same rules:
a +inf row gives log(1/n) to each of its n +inf tokens and -inf to the rest, a row without any
finite or +inf value gives -inf everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember_cupy.engine import device_sampler
from ember_cupy.engine.batched_top_k import draw_top_k
from ember_cupy.engine.sampling_batch import (
    BANNED, BIAS, FREQUENCY, MIN_P, PRESENCE, REPEATED, REPETITION, TEMPERATURE, TOP_P, UNIFORM, SamplingBatch,
    build_batch)
from ember_cupy.engine.sequence import Sequence
from ember_cupy.engine.token_logprobs import TokenLogprobs
from ember_cupy.ops import _cuda, _host
from ember_cupy.structured.bitmask import apply_token_bitmask


# Candidate set sizes tried, in turn, for a top-p without top-k before sorting the whole vocabulary.
TOP_P_CANDIDATES = (256, 2048, 16384)


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
    """The k best (token id, logprob), best first, the lower id first among equals (also at the
    k-th place: the same tokens the device kernel reports)."""
    k = min(k, len(logprobs_row))
    if k <= 0:
        return []
    kth = np.partition(logprobs_row, len(logprobs_row) - k)[len(logprobs_row) - k]
    above = np.flatnonzero(logprobs_row > kth)
    top = np.concatenate([above, np.flatnonzero(logprobs_row == kth)[:k - len(above)]])
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
                          kth: float | None = None, top: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The tokens one temperature-scaled row may sample and their unnormalised probabilities
    (float64), in the order the draw walks them. Empty when the row has no finite or +inf logit.

    kth, if given, is the row's k-th largest logit for k = top_k (or, without top-k but with
    top_p < 1, for k = TOP_P_CANDIDATES[0]); the batch computes it with one partition. top, if
    given, is row.max().
    """
    vocab = row.shape[-1]
    top = row.max() if top is None else np.float32(top)
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

    def __call__(self, logits, seqs: list[Sequence], grammar: tuple[np.ndarray, np.ndarray] | None = None
                 ) -> SamplerOutput:
        """A token (and the logprobs asked for) per row of logits, row i sampled with seqs[i]'s
        parameters and random stream; grammar: (bitmask, rows) from token_bitmasks, masked first.
        Leaves the sequences' grammar state alone (Scheduler.update advances it)."""
        return self._sample_rows(logits, seqs, grammar)

    def _sample_rows(self, logits, seqs: list[Sequence], grammar) -> SamplerOutput:
        """The same steps on the host (NumPy logits) and on the device (CuPy logits: the kernels of
        cuda/sampling.cu; only token ids and the requested logprobs are copied back)."""
        if not seqs:   # a step where nothing samples (mid-prefill): CuPy refuses argmax of (0, vocab)
            return SamplerOutput([], [])
        vocab = logits.shape[-1]
        # one uniform per random row from its own generator, drawn even for a row that turns out
        # empty: a seeded stream stays aligned, and host and device draw the same numbers
        uniforms = [0.0 if seq.params.greedy else seq.generator().random() for seq in seqs]
        batch = build_batch(seqs, vocab, self.eos_token_ids, uniforms)
        raw = logits if logits.dtype == np.float32 else logits.astype(np.float32)
        work = raw
        if grammar is not None or batch.has_edits:
            work = raw.copy()   # private: the mask and the edits write it; logprobs read the raw row
            if grammar is not None:
                apply_token_bitmask(work, *grammar)
            apply_logit_edits(work, batch)
        tokens = sample_tokens(work, batch)
        logprobs = raw_logprobs(raw, batch, tokens) if len(batch.logprob_rows) else None
        token_ids = [int(t) for t in to_host(tokens)]
        return SamplerOutput(token_ids, self._logprob_entries(batch, token_ids, logprobs))

    @staticmethod
    def _logprob_entries(batch: SamplingBatch, token_ids: list[int], logprobs) -> list[TokenLogprobs | None]:
        entries: list[TokenLogprobs | None] = [None] * len(token_ids)
        if logprobs is None:
            return entries
        ids, values, chosen = (to_host(a) for a in logprobs)
        vocab = batch.vocab_size
        for j, (row, n) in enumerate(zip(batch.logprob_rows.tolist(), batch.logprob_counts)):
            n = min(n, vocab)   # a vocabulary smaller than the request has only that many
            top = [(int(t), float(v)) for t, v in zip(ids[j, :n], values[j, :n])]
            entries[row] = TokenLogprobs(token_ids[row], float(chosen[j]), top)
        return entries


def to_host(array) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.get()


# --- the steps: the kernel for device arrays (or under a test provider), else the NumPy twin ----
def apply_logit_edits(logits, batch: SamplingBatch) -> None:
    """min_tokens bans, logit_bias, repetition / frequency / presence penalties, in place."""
    if not batch.has_edits:
        return
    if _cuda.wants_kernel(logits):
        device_sampler.apply_logit_edits_kernel(logits, batch)
    else:
        apply_logit_edits_numpy(logits, batch)


def sample_tokens(logits, batch: SamplingBatch):
    """int32 token id of every row (on the logits' device)."""
    if _cuda.wants_kernel(logits):
        return device_sampler.sample_tokens_kernel(logits, batch)
    return sample_tokens_numpy(logits, batch)


def raw_logprobs(logits, batch: SamplingBatch, tokens):
    """(top ids [r, n], top logprobs [r, n], the sampled token's logprob [r]) of the logprob rows,
    n = the most any of them asked for; from the raw logits (see the module docstring)."""
    if _cuda.wants_kernel(logits):
        return device_sampler.raw_logprobs_kernel(logits, batch, tokens)
    return raw_logprobs_numpy(logits, batch, tokens)


def apply_logit_edits_numpy(logits: np.ndarray, batch: SamplingBatch) -> None:
    """The host path (twin of cuda/sampling.cu's apply_logit_edits): bias added, repetition
    (positive values divided by the penalty, the others multiplied), frequency * count + presence
    subtracted in float64, banned tokens -inf (a ban anywhere in this order gives -inf)."""
    rows = np.repeat(np.arange(batch.num_rows), np.diff(batch.offsets))
    tokens, flags, counts = batch.entries[:, 0], batch.entries[:, 1], batch.entries[:, 2]
    values = logits[rows, tokens]
    with np.errstate(invalid="ignore", over="ignore"):
        values = np.where(flags & BIAS, values + batch.entries[:, 3].view(np.float32), values)
        penalty = batch.reals[:, REPETITION].astype(np.float32)[rows]
        values = np.where(flags & REPEATED, np.where(values > 0, values / penalty, values * penalty), values)
        penalised = values - (batch.reals[:, FREQUENCY][rows] * counts + batch.reals[:, PRESENCE][rows])
        values = np.where(counts > 0, penalised.astype(np.float32), values)
    logits[rows, tokens] = np.where(flags & BANNED, np.float32(-np.inf), values)


def sample_tokens_numpy(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """The host path (twin of cuda/sampling.cu's sample_rows)."""
    tokens = np.zeros(batch.num_rows, dtype=np.int32)
    greedy = np.flatnonzero(batch.greedy)
    if len(greedy):
        tokens[greedy] = argmax_ignoring_nan(logits if len(greedy) == batch.num_rows else logits[greedy])
    random = np.flatnonzero(~batch.greedy)
    if len(random):
        rows = logits if len(random) == batch.num_rows else logits[random]
        tokens[random] = _draw(rows, batch.ints[random], batch.reals[random])
    return tokens


def argmax_ignoring_nan(rows: np.ndarray) -> np.ndarray:
    """Each row's greedy token: the first index of its largest value, NaN never winning (0 when
    none is above -inf). The host kernel (cpu/sampling.c, rows over the thread pool: Gemma 3's
    16 x 262k logits 0.30 ms against NumPy's 0.61 ms, from the caches) or its NumPy twin."""
    library = _host.active()
    if library is None or rows.dtype != np.float32 or rows.ndim != 2 or rows.strides[-1] != 4 or len(rows) < 2:
        return argmax_ignoring_nan_numpy(rows)   # one row: NumPy's own vector loop, without a call into C
    out = np.empty(rows.shape[0], dtype=np.int32)
    library.lib.ember_argmax_rows(rows.ctypes.data, rows.shape[0], rows.shape[1], rows.strides[0] // 4,
                                  out.ctypes.data)
    return out


def argmax_ignoring_nan_numpy(rows: np.ndarray) -> np.ndarray:
    """The twin of ember_argmax_rows. np.argmax stops at a row's first NaN, so only the rows where
    it picked one are redone (no full-batch mask: ~2 ms a step at batch 16)."""
    picked = np.argmax(rows, axis=-1)
    nan_rows = np.flatnonzero(np.isnan(rows[np.arange(len(rows)), picked]))
    if len(nan_rows):
        bad = rows[nan_rows]
        picked[nan_rows] = np.argmax(np.where(np.isnan(bad), np.float32(-np.inf), bad), axis=-1)
    return picked


def _draw(rows: np.ndarray, ints: np.ndarray, reals: np.ndarray) -> np.ndarray:
    """Random rows (read only): temperature, the filters, each row's uniform inverted over its
    kept tokens' CDF. Three passes over the batch: the division (into a new array), the row
    maxima (NaN there means a NaN in the row: only such rows are scrubbed), the k-th largests."""
    logits = rows / reals[:, TEMPERATURE].astype(np.float32)[:, None]
    tops = logits.max(axis=-1)
    for i in np.flatnonzero(np.isnan(tops)):
        logits[i, np.isnan(logits[i])] = -np.inf
        tops[i] = logits[i].max()
    vocab = logits.shape[-1]
    top_k, top_p, min_p = ints[:, 0].tolist(), reals[:, TOP_P].tolist(), reals[:, MIN_P].tolist()
    # the k-th largest logit of every row that needs one, from a single partition
    wanted = [k or (TOP_P_CANDIDATES[0] if p < 1.0 else 0) for k, p in zip(top_k, top_p)]
    need = [i for i, k in enumerate(wanted) if 0 < k < vocab]
    kth: list[float | None] = [None] * len(logits)
    if need:
        subset = logits if len(need) == len(logits) else logits[need]   # no copy when all need one
        for i, value in zip(need, kth_largest(subset, [wanted[i] for i in need])):
            kth[i] = value
    chosen = np.empty(len(logits), dtype=np.int64)
    batched = draw_top_k(logits, top_k, top_p, min_p, kth, tops, reals[:, UNIFORM])
    for i in range(len(logits)):
        if i in batched:
            chosen[i] = batched[i]
            continue
        ids, probs = filtered_distribution(logits[i], top_k[i], top_p[i], min_p[i], kth[i], tops[i])
        if not len(ids):
            chosen[i] = int(np.argmax(logits[i]))   # no distribution: greedy (module docstring)
            continue
        cumulative = np.cumsum(probs)
        pick = np.searchsorted(cumulative, reals[i, UNIFORM] * cumulative[-1], side="right")
        chosen[i] = ids[min(int(pick), len(ids) - 1)]
    return chosen


def raw_logprobs_numpy(logits: np.ndarray, batch: SamplingBatch, tokens: np.ndarray):
    """The host path (twin of cuda/sampling.cu's raw_logprobs)."""
    n = max(batch.logprob_counts)
    rows = batch.logprob_rows
    logprobs = log_softmax(logits[rows])
    ids = np.zeros((len(rows), n), dtype=np.int32)
    values = np.zeros((len(rows), n), dtype=np.float32)
    for j, row in enumerate(logprobs):
        top = top_logprobs(row, n)
        ids[j, :len(top)] = [t for t, _ in top]
        values[j, :len(top)] = [v for _, v in top]
    chosen = logprobs[np.arange(len(rows)), tokens[rows]].astype(np.float32)
    return ids, values, chosen
