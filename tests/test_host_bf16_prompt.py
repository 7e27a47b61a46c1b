"""The prompt rows' kernel (cpu/matmul_bf16.h: x and W in bf16 on AMX-BF16 tiles or AVX512-BF16 vectors) against its
NumPy twin, ops/linear.py matmul_q_bf16_numpy, on machines that have the tiles."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

from ember_cupy.ops import _host
from ember_cupy.ops import linear
from ember_cupy.ops.linear import bf16_prompts_ready, matmul_q_bf16, matmul_q_bf16_numpy, round_to_bf16
from ember_cupy.packed_weight import LAYOUTS, StackedWeight, to_kernel_format
from ember_cupy.quant import QuantizedTensor, half_tensor

pytestmark = pytest.mark.skipif(not bf16_prompts_ready(), reason="neither AMX-BF16 tiles nor AVX512-BF16 on this machine")

_K_QUANT_SCALES = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def _weight(rng, qtype, rows, cols):
    if qtype in _K_QUANT_SCALES:   # gguf cannot quantize K-quants: random bytes with sane f16 scales
        block_bytes, offsets = _K_QUANT_SCALES[qtype]
        data = rng.integers(0, 256, (rows, cols // 256, block_bytes), dtype=np.uint8)
        for offset in offsets:
            data[..., offset:offset + 2] = np.array([0.01], np.float16).view(np.uint8)
        data = data.reshape(rows, -1)
    else:
        data = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, QT[qtype])
    return to_kernel_format(QuantizedTensor(qtype, data, (rows, cols)))


def _assert_close_to_twin(y, x, weight):
    """Equal to the twin within float32 sums: 1e-6 of sum |x| |w| (an error in a scale or a value
    is of the order of the sum itself); non-finite outputs where the twin has them."""
    twin = matmul_q_bf16_numpy(x, weight)
    finite = np.isfinite(twin)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(twin))
    np.testing.assert_array_equal(y[~finite & ~np.isnan(twin)], twin[~finite & ~np.isnan(twin)])
    bound = np.abs(round_to_bf16(np.nan_to_num(x))).astype(np.float64) @ np.abs(weight.dequantize()).astype(np.float64).T
    assert np.all(np.abs(y[finite] - twin[finite]) <= 1e-6 * bound[finite] + 1e-30)


@pytest.mark.parametrize("qtype", list(LAYOUTS))
@pytest.mark.parametrize("rows, out, cols", [(1, 8, 256), (17, 24, 512), (33, 40, 256), (70, 100, 768)])
def test_every_format_equals_its_twin_on_odd_shapes(qtype, rows, out, cols):
    rng = np.random.default_rng(rows * out + cols)
    weight = _weight(rng, qtype, out, cols)
    x = (rng.standard_normal((rows, cols)) * rng.uniform(0.2, 3, cols)).astype(np.float32)
    _assert_close_to_twin(matmul_q_bf16(x, weight), x, weight)


def test_a_stack_of_formats_and_a_16bit_part_and_a_strided_x():
    rng = np.random.default_rng(1)
    half = to_kernel_format(half_tensor(rng.standard_normal((16, 256)).astype(np.float32).astype(np.float16).view(np.uint16), "F16"))
    weight = StackedWeight((_weight(rng, "Q4_K", 40, 256), _weight(rng, "Q6_K", 24, 256), half))
    x = rng.standard_normal((45, 300)).astype(np.float32)[:, 7:263]
    _assert_close_to_twin(matmul_q_bf16(x, weight), x, weight)


def test_non_finite_x_gives_the_twins_non_finite_outputs():
    rng = np.random.default_rng(2)
    weight = _weight(rng, "Q5_K", 24, 256)
    x = rng.standard_normal((20, 256)).astype(np.float32)
    x[3, 5], x[7, :] = np.nan, np.inf
    x[11, 100], x[12, 0] = -np.inf, 1e-40    # a subnormal float reads as zero
    y = matmul_q_bf16(x, weight)
    assert np.isnan(y[3]).all() and not np.isfinite(y[7]).any()
    _assert_close_to_twin(y, x, weight)


def test_a_rows_bits_do_not_depend_on_the_other_rows():
    """The engine's batch invariance: the kernel a row takes depends on its role, and its sums on
    nothing but its own values."""
    rng = np.random.default_rng(3)
    weight = _weight(rng, "Q6_K", 72, 512)
    x = rng.standard_normal((67, 512)).astype(np.float32)
    whole = matmul_q_bf16(x, weight)
    for start, stop in [(0, 1), (5, 9), (30, 67), (16, 48)]:
        np.testing.assert_array_equal(matmul_q_bf16(x[start:stop], weight), whole[start:stop])


def test_round_to_bf16_is_nearest_even():
    # bf16 keeps 7 bits after the point: 1 + 2^-8 is a tie (to 1.0, even), 1 + 3 2^-8 a tie to 1 + 2^-6
    values = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -9, -2.5, np.inf, 3.4e38, 1e-40], np.float32)
    expected = np.array([1.0, 1.0, 1 + 2 ** -6, 1.0, -2.5, np.inf, np.inf, 0.0], np.float32)
    np.testing.assert_array_equal(round_to_bf16(values), expected)
    assert np.isnan(round_to_bf16(np.array([np.nan], np.float32)))[0]


def test_where_the_tiles_are_missing_it_says_so(monkeypatch):
    monkeypatch.setattr(linear, "bf16_prompts_ready", lambda library=None: False)
    with pytest.raises(ValueError, match="AMX-BF16"):
        matmul_q_bf16(np.zeros((1, 256), np.float32), _weight(np.random.default_rng(0), "Q4_0", 8, 256),
                      _host.active())
