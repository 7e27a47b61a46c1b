"""cuda/activation.cu vs the NumPy twin in ember_cupy/ops/activation.py."""
import numpy as np
import pytest

from ember_cupy import ops

from .helpers import DTYPES, assert_close, f32, on_kernel, randn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 2 * 5), (7, 2 * 1536), (2, 2 * 333)])
def test_silu_and_mul(dtype, shape):
    gate_up = randn(np.random.default_rng(5), shape, dtype, scale=3.0)
    got = on_kernel(ops.silu_and_mul, gate_up)
    assert got.shape == (shape[0], shape[1] // 2) and got.dtype == gate_up.dtype
    assert_close(got, ops.silu_and_mul(f32(gate_up)), dtype, scale=3)


def test_silu_and_mul_strided_rows():
    wide = randn(np.random.default_rng(6), (4, 130), "float32")
    gate_up = wide[:, 1:121]
    assert_close(on_kernel(ops.silu_and_mul, gate_up), ops.silu_and_mul(gate_up.copy()), "float32")
