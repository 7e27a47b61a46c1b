"""GPU vs CPU shim vs NumPy twin for every kernel (runs only where CuPy has a device and g++ builds the shim; tools/gpu_check.py, which needs no compiler, compares with the NumPy twins alone)."""
from __future__ import annotations

import numpy as np
import pytest

from ember_cupy import ops

from .helpers import DTYPES, assert_close, f32, on_kernel, randn
from .test_kernel_attention import make_batch
from .test_kernel_rotary import fused_qkv

cupy = pytest.importorskip("cupy")
try:
    cupy.zeros(1).sum()
except Exception as error:  # noqa: BLE001 -- no device, or no driver
    pytest.skip(f"no usable CUDA device ({error})", allow_module_level=True)


def three_ways(op, args, mutated=None):
    """Run op on GPU, on the CPU shim and as the NumPy twin (fp32); return the results as host arrays."""
    gpu_args = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    shim_args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    twin_args = [f32(a) if isinstance(a, np.ndarray) and a.dtype.name in DTYPES else a for a in args]
    outs = [op(*gpu_args), on_kernel(op, *shim_args), op(*twin_args)]
    if mutated is not None:
        outs = [[a[i] for i in mutated] for a in (gpu_args, shim_args, twin_args)]
    return [[cupy.asnumpy(x) if not isinstance(x, np.ndarray) else x for x in
             (o if isinstance(o, (list, tuple)) else [o])] for o in outs]


def agree(results, dtype, scale=1.0):
    gpu, shim, twin = results
    for g, s, t in zip(gpu, shim, twin):
        assert_close(g, t, dtype, scale)
        assert_close(g, s, dtype, scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_norms_activation(dtype):
    rng = np.random.default_rng(30)
    x, r, w = randn(rng, (7, 576), dtype), randn(rng, (7, 576), dtype), randn(rng, (576,), dtype)
    agree(three_ways(ops.rms_norm, [x, w, 1e-5]), dtype)
    agree(three_ways(ops.fused_add_rms_norm, [x, r, w, 1e-5]), dtype, scale=2)
    agree(three_ways(ops.silu_and_mul, [randn(rng, (7, 2 * 1536), dtype)]), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_gpu_rope_and_write_kv(dtype, is_neox):
    rng = np.random.default_rng(31)
    _, q, k = fused_qkv(rng, 9, 9, 3, 64, dtype)
    cache = ops.rope_cos_sin_cache(64, 500, 10000.0)
    positions = rng.integers(0, 500, 9).astype(np.int32)
    agree(three_ways(ops.apply_rope, [q, k, positions, cache, is_neox], mutated=[0, 1]), dtype)
    caches = [randn(rng, (5, 4, 3, 64), dtype) for _ in range(2)]
    slots = np.array([3, -1, 0, 19, 7, 8, -1, 12, 1], np.int32)
    agree(three_ways(ops.write_kv, [q[:, :3], k, *caches, slots], mutated=[2, 3]), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4, 64), (9, 3, 64), (32, 4, 128)])
def test_gpu_paged_attention(dtype, heads):
    rng = np.random.default_rng(32)
    batch = make_batch(rng, [1, 17, 300, 50, 129], [1, 1, 1, 13, 129], 16, *heads, dtype)
    agree(three_ways(ops.paged_attention, [*batch, heads[2] ** -0.5]), dtype)
