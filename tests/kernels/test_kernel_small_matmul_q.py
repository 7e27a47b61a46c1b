"""One small case per kernel of cuda/matmul_q.cu, for the ThreadSanitizer / AddressSanitizer runs
(tools/ci_kernels.sh): the GEMV (1 and 4 rows of x a read), dequantize_range (the large-M path),
dequantize_rows (embedding lookups); the K-quants' too."""
import numpy as np
import pytest

from ember_cupy.ops import linear
from ember_cupy.ops.linear import embedding, matmul_q

from .helpers import assert_close, on_kernel, randn
from .test_kernel_matmul_q import assert_at_scale, device_weight
from .test_kernel_matmul_q_k import k_quant_weight


@pytest.mark.parametrize("qtype, dtype, rows", [("Q4_1", "float16", 1), ("Q8_0", "float32", 3),
                                                ("Q4_0", "bfloat16", 17)])
def test_small_matmul_q(qtype, dtype, rows):
    rng = np.random.default_rng(30)
    _, weight = device_weight(rng, qtype, 10, 64)
    x = randn(rng, (rows, 64), dtype)
    assert_at_scale(on_kernel(matmul_q, x, weight), linear.matmul_q_cuda_numpy(x, weight), dtype)


def test_small_dequantize_rows():
    rng = np.random.default_rng(31)
    tensor, weight = device_weight(rng, "Q4_1", 9, 64)
    ids = np.array([8, 0, 3], np.int64)
    assert_close(on_kernel(embedding, weight, ids, np.float32), tensor.dequantize()[ids], "float32")


@pytest.mark.parametrize("qtype, dtype, rows", [("Q4_K", "float16", 1), ("Q6_K", "float32", 3),
                                                ("Q4_K", "bfloat16", 9), ("Q6_K", "float16", 9)])
def test_small_matmul_q_k(qtype, dtype, rows):
    rng = np.random.default_rng(32)
    _, weight = k_quant_weight(rng, qtype, 10, 256)
    x = randn(rng, (rows, 256), dtype)
    assert_at_scale(on_kernel(matmul_q, x, weight), linear.matmul_q_cuda_numpy(x, weight), dtype)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_small_dequantize_k_rows(qtype):
    rng = np.random.default_rng(33)
    tensor, weight = k_quant_weight(rng, qtype, 9, 256)
    ids = np.array([8, 0, 3], np.int64)
    assert_close(on_kernel(embedding, weight, ids, np.float32), tensor.dequantize()[ids], "float32")
