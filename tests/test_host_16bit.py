"""The 16-bit float matmul (cpu/matmul_16bit.c) against its NumPy twin, on every ISA path this
CPU can run: the same bits (one FMA chain per output over k in order), whatever the batch."""
import ml_dtypes
import numpy as np
import pytest

from ember_cupy.half_weight import fma32, matmul_16bit_numpy, pack_16bit
from ember_cupy.ops import _host
from ember_cupy.ops.linear import matmul_q, matmul_q_numpy
from ember_cupy.ops.pack import pack_16bit_host, to_kernel_format
from ember_cupy.packed_weight import StackedWeight
from ember_cupy.quant import QuantizedTensor, half_tensor, quantize_q8_0

RUNNABLE = [isa for isa in _host.ISA_FLAGS if isa == "portable" or isa in _host.supported_isas()]
NUMPY_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16}


@pytest.fixture(scope="module", params=RUNNABLE)
def library(request):
    return _host.load_library(request.param)


def _tensor(rng, qtype, rows, cols, scale=1.0) -> QuantizedTensor:
    values = (rng.standard_normal((rows, cols)) * scale).astype(NUMPY_DTYPES[qtype])
    return half_tensor(values.view(np.uint16), qtype)


def _same_bits(a, b, message=""):
    """Equal bit for bit, any NaN equal to any NaN (FMA returns one of its NaN operands: which
    one, and so its sign, is the instruction form's choice)."""
    assert np.array_equal(np.isnan(a), np.isnan(b)), message
    np.testing.assert_array_equal(np.where(np.isnan(a), 0, a).view(np.uint32),
                                  np.where(np.isnan(b), 0, b).view(np.uint32), err_msg=message)


@pytest.mark.parametrize("qtype", ["BF16", "F16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, 13, 17, 31])
@pytest.mark.parametrize("shape", [(13, 37), (45, 100), (33, 257)])
def test_matmul_is_the_numpy_twin_bit_for_bit(library, qtype, rows, shape):
    rng = np.random.default_rng(rows)
    weight = to_kernel_format(_tensor(rng, qtype, *shape), library)
    x = rng.standard_normal((rows, shape[1])).astype(np.float32)
    _same_bits(matmul_q(x, weight, library), matmul_16bit_numpy(x, weight))


@pytest.mark.parametrize("qtype", ["BF16", "F16"])
def test_every_isa_path_is_the_portable_path_bit_for_bit(qtype):
    rng = np.random.default_rng(3)
    weight = pack_16bit(_tensor(rng, qtype, 77, 300))
    portable = _host.load_library("portable")
    for rows in (1, 4, 6, 8, 11, 31):
        x = rng.standard_normal((rows, 300)).astype(np.float32) * rng.uniform(0.1, 50, (1, 300)).astype(np.float32)
        expected = matmul_q(x, weight, portable)
        for isa in RUNNABLE:
            _same_bits(matmul_q(x, weight, _host.load_library(isa)), expected, f"{isa} rows={rows}")


def test_each_row_is_the_same_whatever_the_batch_and_the_threads(library):
    rng = np.random.default_rng(4)
    weight = to_kernel_format(_tensor(rng, "BF16", 70, 129), library)
    x = rng.standard_normal((31, 129)).astype(np.float32)
    together = matmul_q(x, weight, library)
    for m in (0, 5, 8, 30):
        _same_bits(matmul_q(x[m:m + 1], weight, library), together[m:m + 1])
        _same_bits(matmul_q(x[m:m + 3], weight, library)[:1], together[m:m + 1])
    threads = library.lib.ember_max_threads()
    library.lib.ember_set_num_threads(1)
    try:
        _same_bits(matmul_q(x, weight, library), together)
    finally:
        library.lib.ember_set_num_threads(threads)


@pytest.mark.parametrize("qtype", ["BF16", "F16"])
def test_non_finite_values_propagate_as_the_twin_says(library, qtype):
    """NaN and inf in x and in W: NaN where a product is NaN or inf - inf, inf where one is."""
    rng = np.random.default_rng(5)
    values = rng.standard_normal((20, 40)).astype(NUMPY_DTYPES[qtype])
    values[2, 3], values[5, 7], values[6, 7], values[9, 0] = np.nan, np.inf, -np.inf, np.inf
    weight = to_kernel_format(half_tensor(values.view(np.uint16), qtype), library)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    x[1, 10], x[3, 0], x[4, 39] = np.nan, np.inf, -np.inf
    x[0, 0] = 0.0                       # 0 * inf: NaN in row 0, column 9
    out = matmul_q(x, weight, library)
    _same_bits(out, matmul_16bit_numpy(x, weight))
    assert np.isnan(out[1]).all() and np.isnan(out[:, 2]).all() and np.isnan(out[0, 9])
    assert np.isinf(out[[0, 2, 5]][:, [5, 6]]).all() and np.isinf(out[2, 9]) and np.isfinite(out[2, :2]).all()
    for isa in RUNNABLE:
        _same_bits(matmul_q(x, weight, _host.load_library(isa)), out, isa)


def test_the_twin_rounds_each_fma_once():
    """fma(5636097, 3, -2^-40): 16908291 - 2^-40 rounds down to 16908290; a float64 product
    plus sum rounds to 16908291 first, a float32 tie that rounds to even (16908292)."""
    tiny = np.float32(-(2.0 ** -40))
    assert fma32(np.float32(5636097), np.float32(3), tiny) == np.float32(16908290)
    assert np.float32(np.float64(5636097) * 3 + np.float64(tiny)) == np.float32(16908292)
    for qtype in ("BF16", "F16"):
        bits = np.array([[1.0, 3.0]], NUMPY_DTYPES[qtype]).view(np.uint16)
        weight = pack_16bit(half_tensor(bits, qtype))
        x = np.array([[tiny, 5636097]], np.float32)
        assert matmul_16bit_numpy(x, weight)[0, 0] == 16908290
        for isa in RUNNABLE:
            assert matmul_q(x, weight, _host.load_library(isa))[0, 0] == 16908290, isa


@pytest.mark.parametrize("rows", [1, 13, 16, 40])
def test_the_pack_kernel_writes_the_twins_panels(library, rows):
    rng = np.random.default_rng(rows)
    tensor = _tensor(rng, "F16", rows, 75)
    packed = pack_16bit_host(tensor, library)
    np.testing.assert_array_equal(packed.data, pack_16bit(tensor).data)
    np.testing.assert_array_equal(packed.dequantize(), tensor.dequantize())
    picked = [rows - 1, 0, rows // 2]
    np.testing.assert_array_equal(packed.dequantize(picked), tensor.dequantize()[picked])


def test_a_stack_of_16_bit_and_quantized_parts_is_its_parts_side_by_side(library):
    """An F16 attn_v beside Q8_0 q/k: one call; the quantized part's x is quantized, the 16-bit
    part's is not."""
    rng = np.random.default_rng(8)
    half = to_kernel_format(_tensor(rng, "F16", 24, 64), library)
    quantized = to_kernel_format(quantize_q8_0(rng.standard_normal((16, 64)).astype(np.float32)), library)
    stacked = StackedWeight((quantized, half))
    x = rng.standard_normal((5, 64)).astype(np.float32)
    together = matmul_q(x, stacked, library)
    np.testing.assert_array_equal(together, np.concatenate([matmul_q(x, quantized, library),
                                                            matmul_q(x, half, library)], axis=1))
    _same_bits(together[:, 16:], matmul_q_numpy(x, stacked)[:, 16:])


def test_bad_arguments_are_refused(library):
    x, w, out = np.zeros((2, 8), np.float32), np.zeros(16 * 8, np.uint16), np.zeros((2, 4), np.float32)
    call = lambda fmt, ldx=8, ldy=4: library.lib.ember_matmul_16bit(  # noqa: E731
        x.ctypes.data, 2, 8, ldx, w.ctypes.data, 4, fmt, out.ctypes.data, ldy)
    assert call(8) == 0 and call(9) == 0
    assert call(7) == -1 and call(10) == -1                # not a 16-bit format
    assert call(8, ldx=7) == -1 and call(8, ldy=3) == -1   # rows overlapping
