"""cuda/matmul_q.cu vs its NumPy twins (ember_cupy/ops/linear.py): weight-only quantized matmul
x @ W^T with W in Q8_0 / Q4_0 / Q4_1 blocks (DeviceQuantizedWeight), x in f32/f16/bf16.
M = 1 and 3, 7 (GEMV: 1 or 4 rows of x a weight read, the last chunk of rows partial) and 17
(dequantized slices + matmul); K a multiple of 32 but not of a warp's 32 chunks (96, 1056);
N not a multiple of the 8 rows of a block."""
import numpy as np
import pytest

from ember_cupy.ops import linear
from ember_cupy.ops.linear import embedding, matmul_q
from ember_cupy.quant import DEVICE_FORMATS, QuantizedTensor, block_columns, to_device_format

from .helpers import DTYPES, assert_close, f32, np_dtype, on_kernel, randn

FORMATS = tuple(q for q in DEVICE_FORMATS if block_columns(q) == 32)   # K-quants: test_kernel_matmul_q_k.py


def device_weight(rng, qtype: str, n: int, k: int):
    """Random [n, k] weights quantized by the gguf package's reference code, as the device holds them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    weight = rng.standard_normal((n, k), dtype=np.float32)
    tensor = QuantizedTensor(qtype, quantize(weight, GGMLQuantizationType[qtype]), (n, k))
    return tensor, to_device_format(tensor, np.ascontiguousarray)


def assert_at_scale(got, want, dtype: str) -> None:
    """Outputs grow with sqrt(K): compare them relative to their largest magnitude."""
    scale = np.abs(f32(want)).max()
    assert_close(f32(got) / scale, f32(want) / scale, dtype)


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 7, 17])
def test_matmul_q_equals_twin(qtype, dtype, rows):
    rng = np.random.default_rng(rows)
    k = 1056 if rows == 3 else 96
    _, weight = device_weight(rng, qtype, 13, k)
    x = randn(rng, (rows, k), dtype)
    got = on_kernel(matmul_q, x, weight)
    assert got.dtype == x.dtype and got.shape == (rows, 13)
    assert_at_scale(got, linear.matmul_q_cuda_numpy(x, weight), dtype)


@pytest.mark.parametrize("qtype", FORMATS)
def test_twin_is_x_times_the_gguf_dequantized_weights(qtype):
    rng = np.random.default_rng(5)
    tensor, weight = device_weight(rng, qtype, 11, 64)
    np.testing.assert_array_equal(weight.dequantize(), tensor.dequantize())
    x = randn(rng, (2, 64), "float32")
    np.testing.assert_allclose(linear.matmul_q_cuda_numpy(x, weight), x @ tensor.dequantize().T, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_logits_in_float32_from_16bit_activations(dtype, rows):
    rng = np.random.default_rng(6)
    _, weight = device_weight(rng, "Q8_0", 21, 128)
    x = randn(rng, (rows, 128), dtype)
    got = on_kernel(matmul_q, x, weight, out_dtype=np.float32)
    want = linear.matmul_q_cuda_numpy(x, weight, np.float32)
    assert got.dtype == np.float32
    # fp32 from the dtype-rounded x on both paths (the large-M scratch is float32 for a float32 output)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_strided_rows_of_x():
    rng = np.random.default_rng(7)
    _, weight = device_weight(rng, "Q4_1", 9, 64)
    wide = randn(rng, (3, 100), "float32")
    x = wide[:, 4:68]                        # rows 400 bytes apart, not 16-byte aligned
    assert_close(on_kernel(matmul_q, x, weight), linear.matmul_q_cuda_numpy(x.copy(), weight), "float32")


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_rows_dequantized_on_the_device(qtype, dtype):
    rng = np.random.default_rng(8)
    tensor, weight = device_weight(rng, qtype, 37, 96)
    ids = np.array([36, 0, 5, 5, 17], np.int64)
    got = on_kernel(embedding, weight, ids, np_dtype(dtype))
    assert got.shape == (5, 96) and got.dtype.name == dtype
    assert_close(got, tensor.dequantize()[ids], dtype)


def test_bad_shapes_are_value_errors():
    rng = np.random.default_rng(9)
    _, weight = device_weight(rng, "Q8_0", 8, 64)
    with pytest.raises(ValueError, match="does not match"):
        on_kernel(matmul_q, randn(rng, (2, 32), "float32"), weight)
    with pytest.raises(ValueError, match="neither"):
        on_kernel(matmul_q, randn(rng, (2, 64), "float16"), weight, out_dtype=np.float64)
    with pytest.raises(ValueError, match="no CUDA kernel for Q5_K"):
        to_device_format(QuantizedTensor("Q5_K", np.zeros((1, 176), np.uint8), (1, 256)), np.asarray)


def test_zero_rows():
    _, weight = device_weight(np.random.default_rng(10), "Q4_0", 8, 32)
    assert on_kernel(matmul_q, np.zeros((0, 32), np.float32), weight).shape == (0, 8)


@pytest.mark.parametrize("qtype", FORMATS)
def test_deterministic_rows_have_the_same_bits_whatever_m(qtype):
    """deterministic: the GEMV for any M, whose row sums do not depend on M, so a row of 1, 6
    (4 + 2 a read) or 37 rows gives the same bits; without it 37 rows take the dequantized
    slices and a matmul, in another order."""
    rng = np.random.default_rng(7)
    _, weight = device_weight(rng, qtype, 13, 1056)
    x = randn(rng, (37, 1056), "float32")
    alone = on_kernel(matmul_q, x[5:6], weight, deterministic=True)
    for rows in (slice(0, 6), slice(0, 37)):
        got = on_kernel(matmul_q, x[rows], weight, deterministic=True)
        assert got[5].tobytes() == alone[0].tobytes(), rows
    assert_at_scale(alone, linear.matmul_q_cuda_numpy(x[5:6], weight), "float32")
