"""cuda/matmul_q.cu's K-quant kernels (Q4_K, Q6_K: blocks of 256 weights read as stored) vs their
NumPy twins (ember_cupy/ops/linear.py; the weights through the host kernels' reference,
ember_cupy/gguf_values.py). M = 1..9 (the GEMV with 1 or 4 rows a read; 9: dequantized slices
and a matmul), N = 13 (not a multiple of a block's 8 rows), K = 768 (24 units of 32 weights: fewer
than a warp's lanes) and 2304 (72: three rounds, the last partial); non-finite x gives the twin's
inf and NaN."""
import numpy as np
import pytest

from ember_cupy.ops import linear
from ember_cupy.ops.linear import embedding, matmul_q
from ember_cupy.quant import DEVICE_FORMATS, QuantizedTensor, block_columns, to_device_format

from .helpers import DTYPES, assert_close, f32, np_dtype, on_kernel, randn
from .test_kernel_matmul_q import assert_at_scale

K_FORMATS = tuple(q for q in DEVICE_FORMATS if block_columns(q) == 256)
# offsets of the f16 scales in a block (d, dmin; Q6_K's d), set to a model's magnitude
_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q6_K": (208,)}


def k_quant_weight(rng, qtype: str, n: int, k: int):
    """Random K-quant blocks (the gguf package cannot quantize to them: any bytes are a valid
    block, the f16 scales set to 0.01), as a QuantizedTensor and as the device holds them."""
    blocks = rng.integers(0, 256, (n, k // 256, DEVICE_FORMATS[qtype]), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[qtype]:
        blocks[..., offset:offset + 2] = np.array([0.01], np.float16).view(np.uint8)
    tensor = QuantizedTensor(qtype, blocks.reshape(n, -1), (n, k))
    return tensor, to_device_format(tensor, np.ascontiguousarray)


def test_the_k_formats_are_served():
    assert K_FORMATS == ("Q4_K", "Q6_K")


@pytest.mark.parametrize("qtype", K_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", range(1, 10))
def test_matmul_q_equals_twin(qtype, dtype, rows):
    rng = np.random.default_rng(rows)
    k = 2304 if rows in (2, 5) else 768
    _, weight = k_quant_weight(rng, qtype, 13, k)
    x = randn(rng, (rows, k), dtype)
    got = on_kernel(matmul_q, x, weight)
    assert got.dtype == x.dtype and got.shape == (rows, 13)
    assert_at_scale(got, linear.matmul_q_cuda_numpy(x, weight), dtype)


@pytest.mark.parametrize("qtype", K_FORMATS)
@pytest.mark.parametrize("rows, deterministic", [(1, False), (4, False), (6, True), (9, False), (9, True)])
def test_non_finite_x_gives_the_twins_inf_and_nan(qtype, rows, deterministic):
    """Each weight is dequantized to its twin value before the FMA with x: an inf in x meets a zero
    weight as NaN and any other as +-inf, on both (factored sums, inf*q + min*inf, would not be)."""
    rng = np.random.default_rng(40 + rows)
    tensor, weight = k_quant_weight(rng, qtype, 13, 512)
    x = randn(rng, (rows, 512), "float32")
    x[0, 7] = np.inf
    x[rows // 2, 300] = -np.inf
    x[rows - 1, 5] = np.nan if rows > 1 else x[rows - 1, 5]
    got = on_kernel(matmul_q, x, weight, deterministic=deterministic)
    want = linear.matmul_q_cuda_numpy(x, weight)
    assert not np.isfinite(want).all() and np.isinf(want).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite], want[~finite])
    if finite.any():      # a single row is all non-finite
        assert_at_scale(got[finite], want[finite], "float32")


@pytest.mark.parametrize("qtype", K_FORMATS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 5, 12])
def test_logits_in_float32_from_16bit_activations(qtype, dtype, rows):
    rng = np.random.default_rng(6)
    _, weight = k_quant_weight(rng, qtype, 21, 256)
    x = randn(rng, (rows, 256), dtype)
    got = on_kernel(matmul_q, x, weight, out_dtype=np.float32)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, linear.matmul_q_cuda_numpy(x, weight, np.float32), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("qtype", K_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_rows_are_the_twins_values(qtype, dtype):
    """The dequantizer rounds each weight once, as the twin: the same bits in every dtype."""
    rng = np.random.default_rng(8)
    tensor, weight = k_quant_weight(rng, qtype, 37, 512)
    ids = np.array([36, 0, 5, 5, 17], np.int64)
    got = on_kernel(embedding, weight, ids, np_dtype(dtype))
    assert got.shape == (5, 512) and got.dtype.name == dtype
    np.testing.assert_array_equal(f32(got), f32(linear.dequantize_rows_numpy(weight, ids, np_dtype(dtype))))
    assert_close(got, tensor.dequantize()[ids], dtype)


@pytest.mark.parametrize("qtype", K_FORMATS)
def test_deterministic_rows_have_the_same_bits_whatever_m(qtype):
    rng = np.random.default_rng(7)
    _, weight = k_quant_weight(rng, qtype, 13, 768)
    x = randn(rng, (23, 768), "float32")
    alone = on_kernel(matmul_q, x[5:6], weight, deterministic=True)
    for rows in (slice(0, 6), slice(0, 23)):
        got = on_kernel(matmul_q, x[rows], weight, deterministic=True)
        assert got[5].tobytes() == alone[0].tobytes(), rows


@pytest.mark.parametrize("qtype", K_FORMATS)
def test_the_device_layout_keeps_the_gguf_bytes(qtype):
    rng = np.random.default_rng(9)
    tensor, weight = k_quant_weight(rng, qtype, 3, 512)
    assert weight.nbytes == tensor.nbytes
    assert weight.quants.shape[1] % 16 == 0 and weight.scales.dtype == np.uint8


@pytest.mark.parametrize("qtype", K_FORMATS)
def test_twin_values_are_gguf_dequantize_on_random_blocks(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    tensor, weight = k_quant_weight(np.random.default_rng(10), qtype, 11, 768)
    want = dequantize(tensor.data, GGMLQuantizationType[qtype]).reshape(11, 768)
    np.testing.assert_array_equal(weight.dequantize(), want)
    np.testing.assert_array_equal(weight.dequantize([9, 2]), want[[9, 2]])


@pytest.fixture(scope="module")
def real_k_blocks():
    """The first 6 rows of a Q4_K and of a Q6_K matrix of the Gemma 3 Q4_K_M file."""
    from gguf import GGUFReader

    from gemma3_model import gemma3_gguf_path
    found = {}
    for tensor in GGUFReader(gemma3_gguf_path()).tensors:
        qtype = tensor.tensor_type.name
        if qtype in K_FORMATS and qtype not in found and len(tensor.shape) == 2:
            cols = int(tensor.shape[0])
            data = np.asarray(tensor.data).reshape(-1, cols // 256 * DEVICE_FORMATS[qtype])[:6]
            found[qtype] = QuantizedTensor(qtype, np.array(data), (6, cols))
    return found


@pytest.mark.parametrize("qtype", K_FORMATS)
def test_twin_and_kernel_on_real_blocks(qtype, real_k_blocks):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    tensor = real_k_blocks[qtype]
    weight = to_device_format(tensor, np.ascontiguousarray)
    want = dequantize(tensor.data, GGMLQuantizationType[qtype]).reshape(tensor.shape)
    np.testing.assert_array_equal(weight.dequantize(), want)
    np.testing.assert_array_equal(on_kernel(embedding, weight, np.arange(6), np.float32), want)
    x = randn(np.random.default_rng(11), (3, tensor.shape[1]), "float32")
    assert_at_scale(on_kernel(matmul_q, x, weight), linear.matmul_q_cuda_numpy(x, weight), "float32")
