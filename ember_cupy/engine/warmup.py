"""Start-up check of the CUDA path: every kernel source compiled and loaded, every kernel the
forward pass and the sampler use launched once, before the engine reports ready.

Kernels otherwise compile lazily, on the first request: a machine whose NVRTC cannot find
cuda_fp16.h, or whose NVRTC cannot load its builtins library, would say ready on /health and then
fail every request. Here it fails at start-up, with NVRTC's error.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from ember_cupy.engine.sampler import apply_logit_edits, raw_logprobs, sample_tokens
from ember_cupy.engine.sampling_batch import build_batch
from ember_cupy.engine.sequence import Sequence
from ember_cupy.ops import _cuda
from ember_cupy.sampling_params import SamplingParams
from ember_cupy.structured.bitmask import apply_token_bitmask

logger = logging.getLogger("ember_cupy.warmup")


class StartupCheckError(RuntimeError):
    """The CUDA path cannot run on this machine; the message says why."""


def _dummy_sampling_batch(vocab: int):
    """One row that reaches every sampling kernel: a min_tokens ban, a bias, penalties, top-k,
    top-p, min-p, a draw, and logprobs."""
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.1,
                            frequency_penalty=0.1, presence_penalty=0.1, logit_bias={0: 1.0}, min_tokens=1,
                            logprobs=1)
    seq = Sequence("warm-up", [0, 1], params, 64)
    return build_batch([seq], vocab, [vocab - 1], np.full(1, 0.5))


def warm_up(runner) -> None:
    """Compile every cuda/*.cu; run the dummy step (a decode row and a prefill) through the model,
    then the bitmask and the sampling kernels on its logits."""
    start = time.perf_counter()
    try:
        for source in sorted(p.name for p in _cuda.CUDA_SOURCE_DIR.glob("*.cu")):
            _cuda.load_module(source)
        logits = runner.dummy_step()
        everything = np.full((1, -(-logits.shape[1] // 32)), -1, np.int32)   # every token allowed
        apply_token_bitmask(logits, everything, np.zeros(1, np.int32))
        finite = bool(runner.xp.isfinite(logits).all())
        batch = _dummy_sampling_batch(int(logits.shape[1]))
        apply_logit_edits(logits, batch)   # bans the last token: no finiteness check after it
        raw_logprobs(logits, batch, sample_tokens(logits, batch))
    except Exception as error:
        raise StartupCheckError(f"the CUDA start-up check failed: {type(error).__name__}: {error}") from error
    if not finite:
        raise StartupCheckError("the CUDA start-up check failed: the dummy step's logits are not finite")
    logger.info("CUDA kernels compiled and launched in %.1f s", time.perf_counter() - start)
