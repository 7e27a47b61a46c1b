"""ops.linear.float_matmul: a row's bits do not depend on how many rows are multiplied with it
(NumPy's OpenBLAS sums a lone row, and small products, in another order than a large GEMM), on
the matrices of the models (C-contiguous [in, out], as the model and DequantizedWeight keep them)."""
import numpy as np
import pytest

from ember_cupy.ops.linear import float_matmul

# SmolLM2-135M: qkv, o, gate_up, down, LM head; Gemma 3 270M: qkv, o, gate_up, down
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152),
          (640, 1536), (1024, 640), (640, 4096), (2048, 640)]


@pytest.mark.parametrize("k,n", SHAPES)
def test_a_row_gets_the_same_bits_whatever_the_rows_with_it(k, n):
    rng = np.random.default_rng(k * n)
    total = 40 if n > 10_000 else 300
    x = rng.standard_normal((total, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    whole = float_matmul(x, w)
    for rows in (1, 2, 3, 4, 7, 16, 33, 100, 299):
        if rows < total:
            np.testing.assert_array_equal(float_matmul(x[total - rows:], w)[-1], whole[-1], err_msg=f"{rows} rows")


def test_it_is_the_product():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((5, 700), dtype=np.float32), rng.standard_normal((700, 9), dtype=np.float32)
    np.testing.assert_allclose(float_matmul(x, w), x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
    assert float_matmul(x[:0], w).shape == (0, 9)
    np.testing.assert_allclose(float_matmul(x[:1], w), x[:1].astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
