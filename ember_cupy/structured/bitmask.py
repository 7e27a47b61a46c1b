"""Token bitmasks: filled by the sequences' constraints, applied to the logits.

A bitmask row holds ceil(V / 32) int32 words; token t is allowed when bit t % 32 of word t // 32
is set (llguidance's layout). `apply_token_bitmask` sets every disallowed logit of the masked rows
to -inf, in place: on the device with the kernel of cuda/sampling.cu (only the mask travels, 6 KB a
row at 49k tokens, not the logits), on the host with cpu/sampling.c's host kernel, or with their
NumPy twin where no host kernel is active.
"""
from __future__ import annotations

import functools

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from ember_cupy.ops import _cuda, _host

_THREADS = 256
_executor: llguidance.LLExecutor | None = None


def fill_bitmasks(constraints: list, vocab_size: int) -> np.ndarray:
    """One bitmask row per constraint, in order; several at once on llguidance's threads."""
    global _executor
    bitmask = llg_numpy.allocate_token_bitmask(len(constraints), vocab_size)
    if len(constraints) == 1:
        constraints[0].fill_bitmask(bitmask, 0)
        return bitmask
    if _executor is None:
        _executor = llguidance.LLExecutor()
    llg_numpy.fill_next_token_bitmask_par(_executor, [(c.matcher, i) for i, c in enumerate(constraints)],
                                          bitmask)
    return bitmask


def token_bitmasks(seqs: list, vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(bitmask, rows) of the sampling rows whose sequence is under a grammar or limited to
    SamplingParams.allowed_token_ids (both: the tokens both allow), or None: what the sampler
    masks. Each matcher is first synced with its sequence's output (a preempted or forked
    sequence's matcher may lag it); the tokens sampled are accepted in Scheduler.update."""
    rows = [i for i, seq in enumerate(seqs) if seq.constraint is not None or seq.params.allowed_token_ids]
    if not rows:
        return None
    grammar_rows = [k for k, i in enumerate(rows) if seqs[i].constraint is not None]
    for k in grammar_rows:
        seqs[rows[k]].constraint.sync(seqs[rows[k]].output_token_ids)
    bitmask = np.full((len(rows), (vocab_size + 31) // 32), -1, dtype=np.int32)
    if grammar_rows:
        bitmask[grammar_rows] = fill_bitmasks([seqs[rows[k]].constraint for k in grammar_rows], vocab_size)
    for k, i in enumerate(rows):
        if seqs[i].params.allowed_token_ids:
            bitmask[k] &= allowed_tokens_bitmask(seqs[i].params.allowed_token_ids, vocab_size)
    return bitmask, np.asarray(rows, dtype=np.int32)


@functools.lru_cache(maxsize=64)
def allowed_tokens_bitmask(token_ids: tuple[int, ...], vocab_size: int) -> np.ndarray:
    """One bitmask row allowing exactly token_ids (read-only: it is shared by every step)."""
    bits = np.zeros((vocab_size + 31) // 32 * 32, dtype=bool)
    bits[list(token_ids)] = True
    row = np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)
    row.flags.writeable = False
    return row


def apply_token_bitmask(logits, bitmask: np.ndarray, rows: np.ndarray) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] is clear, in place."""
    if _cuda.wants_kernel(logits):
        apply_token_bitmask_kernel(logits, bitmask, rows)
    elif _host.active() is not None and logits.dtype == np.float32 and logits.strides[-1] == 4:
        apply_token_bitmask_host(logits, bitmask, rows)
    else:
        apply_token_bitmask_numpy(logits, bitmask, rows)


def apply_token_bitmask_host(logits: np.ndarray, bitmask: np.ndarray, rows: np.ndarray, library=None) -> None:
    """cpu/sampling.c's ember_apply_token_bitmask on float32 logits with unit column stride."""
    library = library or _host.active()
    mask = np.ascontiguousarray(bitmask, dtype=np.int32)
    row_ids = np.ascontiguousarray(rows, dtype=np.int32)
    if len(row_ids) > mask.shape[0]:
        raise ValueError("apply_token_bitmask: more rows than bitmask rows")
    status = library.lib.ember_apply_token_bitmask(
        logits.ctypes.data, logits.shape[0], logits.shape[1], logits.strides[0] // 4,
        mask.ctypes.data, mask.shape[1], row_ids.ctypes.data, len(row_ids))
    if status:
        raise ValueError(f"apply_token_bitmask: a row index is outside the {logits.shape[0]} logit rows")


def apply_token_bitmask_numpy(logits: np.ndarray, bitmask: np.ndarray, rows: np.ndarray) -> None:
    vocab = logits.shape[1]
    bits = np.unpackbits(np.ascontiguousarray(bitmask, dtype=np.int32).view(np.uint8), axis=1,
                         bitorder="little")
    width = min(vocab, bits.shape[1])
    disallowed = bits[:, :width] == 0
    for i, row in enumerate(rows):
        np.copyto(logits[row, :width], -np.inf, where=disallowed[i])
        logits[row, width:] = -np.inf   # a mask narrower than the logits allows nothing beyond it


def apply_token_bitmask_kernel(logits, bitmask: np.ndarray, rows: np.ndarray) -> None:
    """cuda/sampling.cu's apply_token_bitmask on a C-contiguous float32 logits matrix."""
    xp = _array_module(logits)
    if logits.dtype != np.float32 or not logits.flags.c_contiguous:
        raise ValueError("apply_token_bitmask: logits must be a C-contiguous float32 matrix")
    num_rows, vocab = len(rows), logits.shape[1]
    words = bitmask.shape[1]
    mask = xp.asarray(np.ascontiguousarray(bitmask, dtype=np.int32))
    row_ids = xp.asarray(np.ascontiguousarray(rows, dtype=np.int32))
    grid = ((vocab + _THREADS - 1) // _THREADS, num_rows)
    kernel = _cuda.function("sampling.cu", "apply_token_bitmask")
    kernel(grid, (_THREADS,), (logits, mask, row_ids, np.int32(vocab), np.int32(words)))


def _array_module(array):
    if isinstance(array, np.ndarray):
        return np
    import cupy
    return cupy
