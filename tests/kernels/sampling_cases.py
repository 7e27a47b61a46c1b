"""Batches for the sampling kernels' twin tests (test_kernel_sampling_device.py, test_kernel_small_sampling.py)
and the check that a kernel's token equals its twin's wherever floating point cannot decide."""
from __future__ import annotations

import numpy as np

from ember_cupy import SamplingParams
from ember_cupy.engine.sampler import filtered_distribution
from ember_cupy.engine.sampling_batch import MIN_P, TEMPERATURE, TOP_P, UNIFORM, build_batch
from ember_cupy.engine.sequence import Sequence

# relative distance of the draw to a boundary below which either neighbour is right (see the
# tolerance statement of ember_cupy/engine/device_sampler.py: ~3e-7, with room)
MARGIN = 1e-5


def make_batch(params: list[SamplingParams], vocab: int, seed: int, eos=(1,), outputs=None):
    """A SamplingBatch of one sequence per params (prompt and output tokens drawn from seed)."""
    rng = np.random.default_rng(seed)
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(f"s{i}", list(rng.integers(0, vocab, 1 + 3 * i)), p, 50)
        seq.token_ids += list(rng.integers(0, min(vocab, 30), (outputs or [2 * i])[i % len(outputs or [1])]))
        seqs.append(seq)
    return build_batch(seqs, vocab, list(eos), rng.random(len(seqs)))


def rows_of_every_kind(rng, count: int, vocab: int) -> np.ndarray:
    """Smooth, peaked, tied, flat rows, and NaN / +inf / -inf ones, cycled over `count` rows."""
    kinds = [lambda: rng.standard_normal(vocab) * 2, lambda: rng.standard_normal(vocab) * 6,
             lambda: np.round(rng.standard_normal(vocab) * 2), lambda: rng.integers(-2, 2, vocab).astype(float),
             lambda: rng.standard_normal(vocab) * 0.05]
    rows = np.stack([kinds[i % len(kinds)]() for i in range(count)]).astype(np.float32)
    rows[1::7, ::5] = np.nan
    rows[2::9, [3, 7, 11]] = np.inf
    rows[3::11] = -np.inf
    rows[4::13] = np.nan
    rows[5::8, :vocab // 2] = -np.inf
    return rows


def random_params(rng, count: int) -> list[SamplingParams]:
    out = []
    for i in range(count):
        if i % 9 == 0:
            out.append(SamplingParams(temperature=0.0))
            continue
        out.append(SamplingParams(temperature=float(rng.choice([0.3, 0.7, 1.0, 1.8])),
                                  top_k=int(rng.choice([0, 0, 2, 7, 40])),
                                  top_p=float(rng.choice([1.0, 1.0, 0.95, 0.6, 0.2])),
                                  min_p=float(rng.choice([0.0, 0.0, 0.05, 0.3]))))
    return out


def walk(logits_row: np.ndarray, ints_row, reals_row) -> tuple[np.ndarray, np.ndarray, float, bool]:
    """The host path's walk of one random row: (ids, unnormalised probs, the draw's target, clear):
    clear is False where floating point could move the token (a min_p or top-p boundary, or the
    target, within MARGIN of a token's edge)."""
    row = np.where(np.isnan(logits_row), np.float32(-np.inf), logits_row) / np.float32(reals_row[TEMPERATURE])
    top_k, top_p, min_p = int(ints_row[0]), float(reals_row[TOP_P]), float(reals_row[MIN_P])
    ids, probs = filtered_distribution(row, top_k, top_p, min_p)
    if not len(ids):
        return ids, probs, 0.0, True
    cumulative = np.cumsum(probs)
    target = reals_row[UNIFORM] * cumulative[-1]
    edges = np.concatenate([[0.0], cumulative])
    clear = bool(np.min(np.abs(edges - target)) > MARGIN * cumulative[-1])
    if top_p < 1.0:   # the top-p cut: the whole row's kept mass against the limit
        _, full = filtered_distribution(row, top_k, 1.0, min_p)
        limit = top_p * full.sum()
        whole = np.cumsum(np.sort(full)[::-1])
        clear &= bool(np.min(np.abs(whole - limit)) > MARGIN * full.sum())
    if min_p > 0:
        p = np.exp(row - row.max()) if row.max() < np.inf else (row == np.inf).astype(np.float32)
        clear &= bool(np.min(np.abs(p - np.float32(min_p))) > MARGIN)
    return ids, probs, float(target), clear


def assert_same_tokens(got, want, logits, batch, min_clear: float = 0.8) -> None:
    """Equal on every greedy row and every random row whose draw is clear of a boundary; on the
    others, the kernel's token is one the walk keeps. Most rows must be clear."""
    got, want = np.asarray(got), np.asarray(want)
    clear_rows = 0
    for r in range(batch.num_rows):
        if batch.greedy[r]:
            assert got[r] == want[r], r
            clear_rows += 1
            continue
        ids, _, _, clear = walk(logits[r], batch.ints[r], batch.reals[r])
        if clear or not len(ids):
            assert got[r] == want[r], (r, got[r], want[r])
            clear_rows += 1
        else:
            assert got[r] in set(ids.tolist()), (r, got[r])
    assert clear_rows >= min_clear * batch.num_rows, f"only {clear_rows} of {batch.num_rows} rows are clear"
