"""Sampling on the device: the launchers of cuda/sampling.cu's apply_logit_edits, sample_rows and
raw_logprobs. Their NumPy twins, with the same signatures, are the host path itself
(ember_cupy/engine/sampler.py: apply_logit_edits_numpy, sample_tokens_numpy, raw_logprobs_numpy),
and sampler.py picks one or the other per array.

Per step, one host-to-device copy (the SamplingBatch packed: per-row parameters, the random rows'
uniforms, the sparse edits, the logprob rows) and, back, the B token ids and, for the rows that
ask, n <= 20 top logprobs and the sampled token's: never a logits row.

Agreement with the host path. The edits are bit-equal (the same float32 / float64 operations,
no fused multiply-add). A greedy row's token is bit-equal (argmax, NaN never wins, first id among
equals). A random row walks the same tokens in the same order (decreasing value, lower id first;
by id when neither top-k nor top-p sorts) with the same uniform, but its masses differ slightly:
  - p = expf(v - top) in float32 on both sides, but CUDA's expf may differ from NumPy's by up to
    2 ulp (1.2e-7 relative), which can also move a token across an exact min_p boundary;
  - the device sums p in 2^-40 fixed point (exact, order-independent, so deterministic run to
    run), the host in float64 in walk order: each p is rounded by at most 2^-41, so a mass
    differs by at most (number of tokens) * 2^-41 (6e-8 absolute at 128256 tokens, against a
    total >= 1, since the top token has p = 1); a token whose p < 2^-41 has no mass on the device.
So the token equals the host's except where the uniform (times the total) lands within about
3e-7 relative of a boundary between two tokens' cumulative masses, or of the top-p limit; there
a neighbour in the walk may be taken instead. Logprobs are float32 log-softmax values summed in
another order: they agree to about 1e-6; the top-n ids are equal except between tokens whose
logprobs round to the same float32 while their logits differ (ordered by logit here, by id there).
"""
from __future__ import annotations

import numpy as np

from ember_cupy.engine.sampling_batch import SamplingBatch
from ember_cupy.ops import _cuda
from ember_cupy.ops._kernel import array_module, i32, stride

MAX_THREADS = 512         # one block per row
TOKENS_PER_THREAD = 8     # at least, for a small vocabulary (fewer, busier threads)
EDIT_THREADS = 128
MAX_TOP_LOGPROBS = 20     # kMaxTopLogprobs of cuda/sampling.cu


def apply_logit_edits_kernel(logits, batch: SamplingBatch) -> None:
    """In place on float32 logits [batch.num_rows, vocab] with a contiguous last axis."""
    _check(logits, batch)
    views = _device_views(batch, array_module(logits))
    kernel = _cuda.function("sampling.cu", "apply_logit_edits")
    kernel((batch.num_rows,), (EDIT_THREADS,), (logits, views["offsets"], views["entries"], views["reals"],
                                                 stride(logits, 0)))


def sample_tokens_kernel(logits, batch: SamplingBatch):
    """int32 [num_rows] on the logits' device."""
    _check(logits, batch)
    xp = array_module(logits)
    views = _device_views(batch, xp)
    tokens = xp.empty(batch.num_rows, dtype=np.int32)
    kernel = _cuda.function("sampling.cu", "sample_rows")
    kernel((batch.num_rows,), (threads_for(logits.shape[1]),),
           (tokens, logits, views["ints"], views["reals"], i32(logits.shape[1]), stride(logits, 0)))
    return tokens


def raw_logprobs_kernel(logits, batch: SamplingBatch, tokens):
    """(top ids [r, n] int32, top logprobs [r, n] float32, chosen [r] float32) on the device,
    n = max(batch.logprob_counts); tokens: the sampled ids of all rows (int32, on the device)."""
    _check(logits, batch)
    xp = array_module(logits)
    views = _device_views(batch, xp)
    rows, n = len(batch.logprob_rows), max(batch.logprob_counts)
    if n > MAX_TOP_LOGPROBS:
        raise ValueError(f"raw_logprobs: at most {MAX_TOP_LOGPROBS} top logprobs, got {n}")
    ids = xp.empty((rows, MAX_TOP_LOGPROBS), dtype=np.int32)
    values = xp.empty((rows, MAX_TOP_LOGPROBS), dtype=np.float32)
    chosen = xp.empty(rows, dtype=np.float32)
    kernel = _cuda.function("sampling.cu", "raw_logprobs")
    kernel((rows,), (threads_for(logits.shape[1]),),
           (ids, values, chosen, logits, views["logprob_rows"], tokens, i32(logits.shape[1]), stride(logits, 0), i32(n)))
    return ids[:, :n], values[:, :n], chosen


def threads_for(vocab: int) -> int:
    """Threads of a row's block: a multiple of 32, at least 64 (two warps), at most MAX_THREADS."""
    warps = -(-vocab // (32 * TOKENS_PER_THREAD))
    return 32 * min(MAX_THREADS // 32, max(2, warps))


def _check(logits, batch: SamplingBatch) -> None:
    if logits.dtype != np.float32 or logits.ndim != 2 or logits.shape[0] != batch.num_rows:
        raise ValueError(f"sampling kernels take float32 logits [{batch.num_rows}, vocab], "
                         f"got {logits.dtype} {tuple(logits.shape)}")


def _device_views(batch: SamplingBatch, xp) -> dict:
    """The batch's arrays on the device: uploaded in one copy on first use, then reused."""
    if batch.device_views is not None and batch.device_views[0] is xp:
        return batch.device_views[1]
    buffer, layout = batch.pack()
    device = xp.asarray(buffer)
    views = {name: device[start:start + size].view(dtype).reshape(shape)
             for name, (start, size, dtype, shape) in layout.items()}
    batch.device_views = (xp, views)
    return views
