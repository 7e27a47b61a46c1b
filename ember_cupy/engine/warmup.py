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

from ember_cupy.ops import _cuda
from ember_cupy.structured.bitmask import apply_token_bitmask

logger = logging.getLogger("ember_cupy.warmup")


class StartupCheckError(RuntimeError):
    """The CUDA path cannot run on this machine; the message says why."""


def warm_up(runner) -> None:
    """Compile every cuda/*.cu, run one dummy token through the model and the bitmask kernel."""
    start = time.perf_counter()
    try:
        for source in sorted(p.name for p in _cuda.CUDA_SOURCE_DIR.glob("*.cu")):
            _cuda.load_module(source)
        logits = runner.dummy_step()
        everything = np.full((1, -(-logits.shape[1] // 32)), -1, np.int32)   # every token allowed
        apply_token_bitmask(logits, everything, np.zeros(1, np.int32))
        finite = bool(runner.xp.isfinite(logits).all())
    except Exception as error:
        raise StartupCheckError(f"the CUDA start-up check failed: {type(error).__name__}: {error}") from error
    if not finite:
        raise StartupCheckError("the CUDA start-up check failed: the dummy step's logits are not finite")
    logger.info("CUDA kernels compiled and launched in %.1f s", time.perf_counter() - start)
