"""cuda/norm.cu vs the NumPy twins in ember_cupy/ops/norm.py."""
import numpy as np
import pytest

from ember_cupy import ops

from .helpers import DTYPES, assert_close, f32, on_kernel, randn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (5, 77), (3, 576), (2, 1333)])
def test_rms_norm(dtype, shape):
    rng = np.random.default_rng(1)
    x, weight = randn(rng, shape, dtype), randn(rng, shape[1:], dtype)
    got = on_kernel(ops.rms_norm, x, weight, 1e-5)
    assert got.dtype == x.dtype and got.shape == shape
    assert_close(got, ops.rms_norm(f32(x), f32(weight), 1e-5), dtype)


def test_rms_norm_strided_rows():
    rng = np.random.default_rng(2)
    wide = randn(rng, (4, 100), "float32")
    x, weight = wide[:, 10:73], randn(rng, (63,), "float32")
    assert_close(on_kernel(ops.rms_norm, x, weight, 1e-6), ops.rms_norm(x.copy(), weight, 1e-6), "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 9), (6, 576), (3, 1001)])
def test_fused_add_rms_norm_in_place(dtype, shape):
    rng = np.random.default_rng(3)
    x, residual, weight = randn(rng, shape, dtype), randn(rng, shape, dtype), randn(rng, shape[1:], dtype)
    want_x, want_residual = ops.fused_add_rms_norm(f32(x), f32(residual), f32(weight), 1e-5)
    got_x, got_residual = on_kernel(ops.fused_add_rms_norm, x, residual, weight, 1e-5)
    assert got_x is x and got_residual is residual
    assert_close(residual, want_residual, dtype)
    assert_close(x, want_x, dtype, scale=2)


def test_fused_add_rms_norm_strided():
    rng = np.random.default_rng(4)
    x_wide, r_wide = randn(rng, (5, 90), "float32"), randn(rng, (5, 70), "float32")
    x, residual, weight = x_wide[:, :64], r_wide[:, 3:67], randn(rng, (64,), "float32")
    want = ops.fused_add_rms_norm(x.copy(), residual.copy(), weight, 1e-5)
    before = x_wide[:, 64:].copy()
    on_kernel(ops.fused_add_rms_norm, x, residual, weight, 1e-5)
    assert_close(x, want[0], "float32")
    assert_close(residual, want[1], "float32")
    np.testing.assert_array_equal(x_wide[:, 64:], before)
