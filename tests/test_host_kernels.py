"""Host kernels (cpu/*.c) against their NumPy twins, on every ISA path this CPU can run."""
import ctypes
import logging
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

from ember_cupy.ops import _host, host_build
from ember_cupy.ops.linear import matmul_q, matmul_q_numpy
from ember_cupy.ops.pack import pack_host
from ember_cupy.packed_weight import LAYOUTS, StackedWeight, pack, to_kernel_format
from ember_cupy.quant import ActivationQuantization, QuantizedTensor, concat_rows, fake_quantize_activations

RUNNABLE = [isa for isa in _host.ISA_FLAGS if isa == "portable" or isa in _host.supported_isas()]


@pytest.fixture(scope="module", params=RUNNABLE)
def library(request):
    return _host.load_library(request.param)


# K-quant blocks (gguf cannot quantize them): random bytes with sane f16 scales at these offsets
_K_QUANT_SCALES = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}
FORMATS = list(LAYOUTS)


def _raw_k_quant(rng, qtype, rows, cols):
    block_bytes, scale_offsets = _K_QUANT_SCALES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // 256, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        blocks[..., offset:offset + 2] = np.array([0.01], np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _weight_data(rng, qtype, rows, cols):
    if qtype in _K_QUANT_SCALES:
        return _raw_k_quant(rng, qtype, rows, cols)
    return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, QT[qtype])


def _weight(rng, qtype, rows, cols):
    return to_kernel_format(QuantizedTensor(qtype, _weight_data(rng, qtype, rows, cols), (rows, cols)))


def test_the_library_reports_the_path_it_was_built_for(library):
    assert library.lib.ember_isa().decode() == library.isa
    assert library.threads >= 1


def test_best_isa_follows_the_cpu_flags():
    assert _host.best_isa(set()) == "portable"
    assert _host.best_isa({"avx2", "fma", "f16c"}) == "avx2"
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert _host.best_isa(avx512) == "avx512vnni"
    assert _host.best_isa(avx512 | {"amx_tile", "amx_int8"}) == "avx512amx"


CPUINFO = Path(__file__).parent / "fixtures" / "cpuinfo"


@pytest.mark.parametrize("machine, isa, has_i8mm", [("raspberry_pi5_cortex_a76", "neon-dotprod", False),
                                                    ("graviton3_neoverse_v1", "neon-i8mm", True),
                                                    ("raspberry_pi3_cortex_a53", "neon", False)])
def test_arm_cpus_take_their_path_from_the_features_line(machine, isa, has_i8mm):
    flags = _host.parse_cpu_flags((CPUINFO / f"{machine}.txt").read_text())
    assert "asimd" in flags and ("i8mm" in flags) == has_i8mm
    assert _host.best_isa(flags) == isa


@pytest.mark.parametrize("hwcap, hwcap2, isa, has_i8mm", [(0x119FFF, 0x0, "neon-dotprod", False),    # Pi 5
                                                         (0x1FFFFF, 0x2000, "neon-i8mm", True),      # Graviton 3
                                                         (0x887, 0x0, "neon", False)])               # Pi 3
def test_arm_cpus_take_their_path_from_getauxval(monkeypatch, hwcap, hwcap2, isa, has_i8mm):
    """AT_HWCAP bit 1 asimd, 20 asimddp; AT_HWCAP2 bit 13 i8mm: read beside /proc/cpuinfo on aarch64."""
    flags = _host.flags_from_hwcaps({16: hwcap, 26: hwcap2})
    assert _host.best_isa(flags) == isa and ("i8mm" in flags) == has_i8mm
    monkeypatch.setattr(_host.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(_host, "_auxv_hwcaps", lambda: {16: hwcap, 26: hwcap2})
    assert flags <= _host.cpu_flags()


def test_x86_flags_are_read_from_the_flags_line_not_vmx_flags():
    text = "processor\t: 0\nflags\t\t: fpu avx2 fma f16c\nvmx flags\t: ept vpid\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert _host.parse_cpu_flags(text) == {"fpu", "avx2", "fma", "f16c"}


def test_each_architecture_builds_its_own_paths():
    assert host_build.machine_isas("x86_64")[-1] == host_build.machine_isas("aarch64")[-1] == "portable"
    assert set(host_build.machine_isas("aarch64")) == {"neon-i8mm", "neon-dotprod", "neon", "portable"}
    assert host_build.machine_isas("arm64") == host_build.machine_isas("aarch64")
    assert "-DEMBER_USE_NEON" in host_build.flags("neon") and "+dotprod" in " ".join(host_build.flags("neon-dotprod"))


def test_a_path_the_os_refuses_falls_back_to_the_next(monkeypatch, caplog):
    """AMX needs the kernel's permission (arch_prctl): refused, the AVX-512 path loads instead."""
    tried = []

    class Refusing:
        def __init__(self, isa):
            tried.append(isa)
            if isa == "avx512amx":
                raise _host.HostKernelError("refused")
            self.isa = isa

    monkeypatch.setattr(_host, "HostLibrary", Refusing)
    monkeypatch.setattr(_host, "supported_isas", lambda: ["avx512amx", "avx512vnni", "avx2", "portable"])
    with caplog.at_level(logging.WARNING, logger="ember_cupy.host"):
        assert _host._best_loadable().isa == "avx512vnni"
    assert tried == ["avx512amx", "avx512vnni"] and "avx512amx path unavailable" in caplog.text


def test_every_isa_path_compiles():
    """Every path of this architecture builds here even where the CPU cannot run it (a compile
    check); the other architecture's paths: tests/test_host_aarch64.py."""
    for isa in host_build.machine_isas():
        assert _host._build(isa).exists()


def test_activation_quantization_is_bitwise_the_twins(library):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 96)).astype(np.float32) * rng.uniform(0.01, 30, (5, 1)).astype(np.float32)
    x[2, :32] = 0.0                                   # an all-zero block: d = 0
    q = np.empty((5, 96), np.int8)
    d = np.empty((5, 3), np.float32)
    s = np.empty((5, 3), np.float32)
    library.lib.ember_quantize_q8(x.ctypes.data, 5, 96, 96, q.ctypes.data, d.ctypes.data, s.ctypes.data)
    restored = (q.reshape(5, 3, 32) * d[..., None]).reshape(5, 96)
    np.testing.assert_array_equal(restored, fake_quantize_activations(x))
    np.testing.assert_allclose(s, d * q.reshape(5, 3, 32).sum(-1), rtol=1e-6)


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
def test_matmul_equals_the_numpy_twin(library, qtype, rows):
    rng = np.random.default_rng(rows)
    cols = 256 if qtype in _K_QUANT_SCALES else 96
    weight = _weight(rng, qtype, 37, cols)            # 37 rows: tiles with every edge case
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    ours, twin = matmul_q(x, weight, library), matmul_q_numpy(x, weight)
    np.testing.assert_allclose(ours, twin, rtol=2e-5, atol=2e-5 * np.abs(twin).max())


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("qtype", FORMATS)
def test_a_non_finite_activation_makes_its_row_nan_like_the_twin(library, qtype, passes):
    """NaN or inf in a block of x: that row's outputs are NaN (its block's d is NaN, its q 0: an
    int conversion of NaN is undefined in C, and x86 and ARM gave different finite garbage)."""
    rng = np.random.default_rng(7)
    cols = 256 if qtype in _K_QUANT_SCALES else 96
    weight = _weight(rng, qtype, 13, cols)
    x = rng.standard_normal((4, cols)).astype(np.float32)
    x[0, 3], x[1, 40], x[2, 70] = np.nan, np.inf, -np.inf
    scheme = ActivationQuantization(passes, 0.5)
    ours = matmul_q(x, weight, library, scheme)
    with np.errstate(invalid="ignore"):
        twin = matmul_q_numpy(x, weight, scheme)
    assert np.isnan(ours[:3]).all() and np.isnan(twin[:3]).all()
    np.testing.assert_allclose(ours[3], twin[3], rtol=2e-5, atol=2e-5 * np.abs(twin[3]).max())


@pytest.mark.parametrize("threshold, gain", [(0.0, 20), (0.5, 5)])   # every block, the outlier's
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_two_pass_activations_equal_the_twin_and_are_closer_to_fp32(library, qtype, rows, threshold, gain):
    rng = np.random.default_rng(rows)
    weight = _weight(rng, qtype, 24, 128)
    x = rng.standard_normal((rows, 128)).astype(np.float32)
    x[:, 5] *= 40                                   # an outlier: int8 blocks lose the small values
    two = ActivationQuantization(passes=2, second_pass_threshold=threshold)
    ours, twin = matmul_q(x, weight, library, two), matmul_q_numpy(x, weight, two)
    np.testing.assert_allclose(ours, twin, rtol=2e-5, atol=2e-5 * np.abs(twin).max())
    exact = x @ weight.dequantize().T
    assert np.abs(ours - exact).max() < np.abs(matmul_q(x, weight, library) - exact).max() / gain
    single = matmul_q(x[:1], weight, library, two)[0]
    np.testing.assert_array_equal(single, ours[0])                     # batch invariant


def test_the_second_pass_takes_the_blocks_with_the_largest_scales():
    """Two passes hold x to 16 bits (d = max|x| / 32512: within d / 2) in the selected blocks; the
    others keep 255 hi alone, a grid of 255 d (within 128 d: about int8)."""
    x = np.random.default_rng(7).standard_normal((2, 128)).astype(np.float32)
    x[0, 5] = 60.0                                  # row 0: block 0 holds most of the rounding error
    selected = fake_quantize_activations(x, ActivationQuantization(2, 0.5))
    every = fake_quantize_activations(x, ActivationQuantization(2, 0.0))
    d = np.abs(x.reshape(2, 4, 32)).max(-1) / np.float32(32512)
    step = np.repeat(d, 32, axis=1).astype(np.float64)
    assert (np.abs(every - x) <= 0.5001 * step).all()
    d2 = (np.abs(x.reshape(2, 4, 32)).max(-1) / 127).astype(np.float64) ** 2
    kept = d2 >= 0.5 * d2.mean(axis=1, keepdims=True)
    assert kept[0].tolist() == [True, False, False, False]
    kept = np.repeat(kept, 32, axis=1)
    np.testing.assert_array_equal(selected[kept], every[kept])
    grid = selected[~kept] / (255 * step[~kept])
    np.testing.assert_allclose(grid, np.rint(grid), atol=1e-6)
    assert (np.abs(selected - x)[~kept] <= 128.001 * step[~kept]).all()
    assert np.abs(selected - x)[~kept].max() > 20 * np.abs(every - x)[~kept].max()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_the_kernel_selects_the_twins_second_pass_blocks(library, qtype):
    """Where the threshold drops the second pass changes the result by far more than the kernel
    and the twin differ; a second pass no block reaches leaves x at about int8 (255 hi alone):
    the twin's, and about as far from fp32 as one pass."""
    rng = np.random.default_rng(8)
    weight = _weight(rng, qtype, 40, 256)
    x = rng.standard_normal((9, 256)).astype(np.float32) * rng.uniform(0.2, 5, (1, 256)).astype(np.float32)
    selected = ActivationQuantization(2, 0.7)
    ours, twin = matmul_q(x, weight, library, selected), matmul_q_numpy(x, weight, selected)
    every = matmul_q(x, weight, library, ActivationQuantization(2, 0.0))
    assert np.abs(every - ours).max() > 50 * np.abs(ours - twin).max()
    none = ActivationQuantization(2, 1e30)
    hi_only, twin = matmul_q(x, weight, library, none), matmul_q_numpy(x, weight, none)
    np.testing.assert_allclose(hi_only, twin, rtol=2e-5, atol=2e-5 * np.abs(twin).max())
    exact = x @ weight.dequantize().T
    once_error = np.abs(matmul_q(x, weight, library) - exact).max()
    assert once_error / 2 < np.abs(hi_only - exact).max() < 2 * once_error


def test_matmul_reads_strided_rows(library):
    rng = np.random.default_rng(3)
    weight = _weight(rng, "Q4_1", 20, 64)
    wide = rng.standard_normal((6, 100)).astype(np.float32)
    x = wide[:, 4:68]
    np.testing.assert_array_equal(matmul_q(x, weight, library), matmul_q(np.ascontiguousarray(x), weight, library))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_each_row_is_the_same_whatever_the_batch(library, qtype):
    """Batch invariance: a row's result does not depend on the rows computed with it."""
    rng = np.random.default_rng(4)
    weight = _weight(rng, qtype, 70, 128)
    x = rng.standard_normal((17, 128)).astype(np.float32)
    together = matmul_q(x, weight, library)
    for i in (0, 3, 16):
        np.testing.assert_array_equal(matmul_q(x[i:i + 1], weight, library)[0], together[i])
    np.testing.assert_array_equal(matmul_q(x[5:11], weight, library), together[5:11])


@pytest.mark.parametrize("isa", ["avx512vnni", "avx512amx"])
@pytest.mark.parametrize("rows", [3, 11, 40])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_the_avx512_paths_are_the_avx2_path_bit_for_bit(isa, qtype, passes, rows):
    """The 512-bit kernels take two weight groups at once (Q8_0 as w + 128), AMX 16 rows of x
    per tile (from 16 int8 rows); every output is the 256-bit path's integer sums and float steps,
    in the same order. 37 weight rows: a lone group beside the pairs."""
    if isa not in RUNNABLE:
        pytest.skip(f"this CPU cannot run the {isa} path")
    rng = np.random.default_rng(rows)
    weight = _weight(rng, qtype, 37, 160)
    x = rng.standard_normal((rows, 160)).astype(np.float32) * rng.uniform(0.1, 9, (1, 160)).astype(np.float32)
    x[1, 32:64] = 0.0
    scheme = ActivationQuantization(passes, 0.5)
    wide, narrow = _host.load_library(isa), _host.load_library("avx2")
    np.testing.assert_array_equal(matmul_q(x, weight, wide, scheme), matmul_q(x, weight, narrow, scheme))


@pytest.mark.parametrize("qtype", FORMATS)
def test_every_format_is_served_in_its_own_blocks(qtype):
    """Packed as stored (the bytes a GGUF row holds; K-quants +4 per 256 for whole-byte scales),
    and the packed rows dequantize to what gguf's reference dequantizer gives, bit for bit."""
    rng = np.random.default_rng(6)
    source = QuantizedTensor(qtype, _weight_data(rng, qtype, 13, 512), (13, 512))
    served = to_kernel_format(source)
    assert served.qtype == qtype
    extra = 4 * 512 // 256 if qtype in ("Q4_K", "Q5_K") else 0
    assert served.nbytes == 16 * (source.data.shape[1] + extra)            # 13 rows padded to 16
    np.testing.assert_array_equal(served.dequantize(), source.dequantize())
    rows = np.array([12, 0, 7, 7, 8])
    np.testing.assert_array_equal(served.dequantize(rows), source.dequantize()[rows])


def test_a_format_without_a_kernel_is_requantized_to_q8_0():
    rng = np.random.default_rng(6)
    blocks = rng.integers(0, 256, (4, 8, 18), dtype=np.uint8)              # IQ4_NL: f16 d, 16 bytes
    blocks[..., :2] = np.array([0.01], np.float16).view(np.uint8)
    source = QuantizedTensor("IQ4_NL", blocks.reshape(4, -1), (4, 256))
    served = to_kernel_format(source)
    assert served.qtype == "Q8_0"
    reference = source.dequantize()
    assert np.abs(served.dequantize() - reference).max() <= np.abs(reference).max() / 127


@pytest.mark.parametrize("cols", [4096, 4352])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("qtype", FORMATS)
def test_a_lone_row_is_the_portable_path_bit_for_bit_on_short_and_long_rows(qtype, passes, cols):
    """One row of x takes the weight groups one at a time up to K = 4096 and the 512-bit pairs
    beyond (cpu/matmul_q.c, LONE_ROW_PAIRS_FROM_K): both give every other path's bits."""
    rng = np.random.default_rng(cols)
    weight = _weight(rng, qtype, 37, cols)
    x = rng.standard_normal((1, cols)).astype(np.float32) * rng.uniform(0.1, 9, (1, cols)).astype(np.float32)
    scheme = ActivationQuantization(passes, 0.5)
    portable = matmul_q(x, weight, _host.load_library("portable"), scheme)
    for isa in RUNNABLE:
        np.testing.assert_array_equal(matmul_q(x, weight, _host.load_library(isa), scheme), portable, err_msg=isa)


@pytest.mark.parametrize("rows", [1, 3, 5, 6, 11, 40])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("qtype", FORMATS)
def test_every_isa_path_is_the_portable_path_bit_for_bit(qtype, passes, rows):
    """Exact integer sums and the same float steps (fused multiply-adds) on every path; the
    512-bit pairs take up to 12 int8 rows in one tile (5 and 6 rows of x, two passes), AMX from 16
    int8 rows. 37 weight rows: a lone group beside the pairs; a zero block of x."""
    rng = np.random.default_rng(rows)
    weight = _weight(rng, qtype, 37, 512)
    x = rng.standard_normal((rows, 512)).astype(np.float32) * rng.uniform(0.1, 9, (1, 512)).astype(np.float32)
    x[rows // 2, 32:64] = 0.0
    scheme = ActivationQuantization(passes, 0.5)
    portable = matmul_q(x, weight, _host.load_library("portable"), scheme)
    # every result kept: a freed output's memory, reused by the next call's np.empty, would hide
    # rows a path left unwritten
    results = {isa: matmul_q(x, weight, _host.load_library(isa), scheme) for isa in RUNNABLE}
    for isa, result in results.items():
        np.testing.assert_array_equal(result, portable, err_msg=isa)


@pytest.mark.parametrize("rows", [3, 11])        # 11: 22 int8 rows, AMX's tiles where the CPU has them
@pytest.mark.parametrize("qtype", [qtype for qtype in FORMATS if qtype not in _K_QUANT_SCALES])
def test_a_skipped_second_pass_adds_nothing_even_to_an_infinite_scale(qtype, rows):
    """The portable path skips the lo row of a block whose 16 bits the threshold drops (its d = 0
    marks it); the SIMD paths compute it (zeros, no branch): the same bits, also where an infinite
    weight scale meets it. Block 0 of x is small (its lo dropped), and 3 weight rows have d = inf
    there: their outputs are +-inf on every path, as the portable path's. (A K-quant's d spans 8
    blocks, whose infinite sums of both signs are NaN anyway; their tile is Q4_0's and Q5_x's.)"""
    rng = np.random.default_rng(7)
    data = np.ascontiguousarray(_weight_data(rng, qtype, 37, 512))
    for row in (0, 9, 20):
        data[row, 0:2] = np.array([np.inf], np.float16).view(np.uint8)   # block 0's d
    weight = to_kernel_format(QuantizedTensor(qtype, data, (37, 512)))
    x = rng.standard_normal((rows, 512)).astype(np.float32) * 4
    x[:, :32] *= 0.01
    scheme = ActivationQuantization(2, 0.5)
    portable = matmul_q(x, weight, _host.load_library("portable"), scheme)
    assert np.isinf(portable[:, [0, 9, 20]]).sum() >= 2 * rows
    for isa in RUNNABLE:
        np.testing.assert_array_equal(matmul_q(x, weight, _host.load_library(isa), scheme), portable, err_msg=isa)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_a_matrix_of_several_weight_blocks_is_computed_whole(library, qtype):
    """Each thread sweeps its weight groups a block of ~256 KB at a time against every chunk of x:
    4096 columns make a Q8_0 group 35 KB, a Q4_K one 19 KB (blocks of 6, 12 groups): 38 groups and
    24 rows of x (6 chunks) cross block and chunk edges; the output is the twin's and every path's."""
    rng = np.random.default_rng(4)
    weight = _weight(rng, qtype, 301, 4096)
    x = rng.standard_normal((24, 4096)).astype(np.float32)
    scheme = ActivationQuantization(2, 0.35)
    ours = matmul_q(x, weight, library, scheme)
    twin = matmul_q_numpy(x, weight, scheme)
    np.testing.assert_allclose(ours, twin, rtol=2e-5, atol=2e-5 * np.abs(twin).max())
    np.testing.assert_array_equal(ours, matmul_q(x, weight, _host.load_library("portable"), scheme))


@pytest.mark.parametrize("rows", [1, 8, 13, 40])
@pytest.mark.parametrize("qtype", FORMATS)
def test_the_pack_kernel_writes_the_twins_bytes(library, qtype, rows):
    """cpu/pack.c against packed_weight.pack, from a strided view of the file's rows too."""
    rng = np.random.default_rng(rows)
    data = _weight_data(rng, qtype, rows, 512)
    source = QuantizedTensor(qtype, data, (rows, 512))
    twin = pack(source)
    np.testing.assert_array_equal(pack_host([source], library).data, twin.data)
    wide = np.concatenate([data, np.zeros((rows, 7), np.uint8)], axis=1)[:, :data.shape[1]]
    np.testing.assert_array_equal(pack_host([QuantizedTensor(qtype, wide, (rows, 512))], library).data, twin.data)


@pytest.mark.parametrize("part_rows", [(16, 8, 13), (8, 13, 24), (40, 1)])
@pytest.mark.parametrize("qtype", FORMATS)
def test_parts_packed_in_place_are_the_packed_stack(library, qtype, part_rows):
    """A fused q/k/v or gate/up packed part by part into its rows (a middle part of 13 rows is
    concatenated first) has the bytes of the stacked matrix packed whole."""
    rng = np.random.default_rng(sum(part_rows))
    parts = [QuantizedTensor(qtype, _weight_data(rng, qtype, rows, 512), (rows, 512)) for rows in part_rows]
    whole = pack(concat_rows(parts))
    packed = pack_host(parts, library)
    assert packed.shape == whole.shape
    np.testing.assert_array_equal(packed.data, whole.data)


def test_a_stacked_weight_is_its_parts_side_by_side(library):
    """q/k/v of a K-quant file in three formats: one call, x quantized once, each part's columns
    the bits of that part alone."""
    rng = np.random.default_rng(9)
    parts = [_weight(rng, "Q4_K", 20, 256), _weight(rng, "Q6_K", 9, 256), _weight(rng, "Q8_0", 16, 256)]
    stacked = StackedWeight(tuple(parts))
    x = rng.standard_normal((10, 256)).astype(np.float32)
    together = matmul_q(x, stacked, library)
    np.testing.assert_array_equal(together, np.concatenate([matmul_q(x, p, library) for p in parts], axis=1))
    np.testing.assert_allclose(together, matmul_q_numpy(x, stacked), rtol=2e-5, atol=2e-5 * np.abs(together).max())


def test_bad_arguments_are_refused(library):
    x = np.zeros((1, 40), np.float32)
    out = np.zeros(4, np.float32)
    status = library.lib.ember_matmul_q(x.ctypes.data, 1, 40, 40, ctypes.c_void_p(0), 4, 1, out.ctypes.data, 4, 1, 0.0)
    assert status == -1                               # K not a multiple of 32
    x = np.zeros((1, 96), np.float32)
    status = library.lib.ember_matmul_q(x.ctypes.data, 1, 96, 96, ctypes.c_void_p(1), 4, 2, out.ctypes.data, 4, 1, 0.0)
    assert status == -1                               # Q4_K needs a multiple of 256 columns
    status = library.lib.ember_matmul_q(x.ctypes.data, 1, 96, 96, ctypes.c_void_p(1), 4, 10, out.ctypes.data, 4, 1, 0.0)
    assert status == -1                               # no such format (8, 9: BF16, F16)
    with pytest.raises(ValueError, match="does not match"):
        matmul_q(np.zeros((1, 64), np.float32), _weight(np.random.default_rng(0), "Q8_0", 4, 96), library)


def test_no_compiler_means_the_numpy_path(monkeypatch, caplog):
    """A $CC that is not there is no compiler. Its warning comes with the model load, which knows
    what the NumPy path costs (tests/test_host_no_compiler.py); here it is information."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("EMBER_KERNEL_CACHE", "/nonexistent-cache")
    _host.load_library.cache_clear()
    _host.active.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="ember_cupy.host"):
            assert _host.active() is None
        assert "NumPy path" in caplog.text and "/nonexistent/cc" in caplog.text
        assert isinstance(_host.unavailable(), _host.NoCompilerError)
        weight = _weight(np.random.default_rng(0), "Q8_0", 4, 64)
        x = np.ones((2, 64), np.float32)
        np.testing.assert_array_equal(matmul_q(x, weight), matmul_q_numpy(x, weight))
    finally:
        _host.load_library.cache_clear()
        _host.active.cache_clear()


def test_packed_rows_dequantize_like_the_gguf_rows():
    rng = np.random.default_rng(7)
    source = QuantizedTensor("Q8_0", quantize(rng.standard_normal((37, 64)).astype(np.float32), QT.Q8_0), (37, 64))
    packed = to_kernel_format(source)
    rows = np.array([36, 0, 5, 5, 17])
    np.testing.assert_array_equal(packed.dequantize(rows), source.dequantize()[rows])
    np.testing.assert_array_equal(packed.dequantize(), source.dequantize())


def test_a_first_compile_says_so_before_it_starts(monkeypatch, tmp_path, caplog):
    """The first use on an empty kernel cache compiles for many seconds: the log says what and why first."""
    if _host.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("EMBER_KERNEL_CACHE", str(tmp_path))
    logged_before_compiling = []
    monkeypatch.setattr(_host.host_build, "compile_library",
                        lambda cc, isa, sources, target: logged_before_compiling.append(caplog.text) or target)
    with caplog.at_level(logging.WARNING, logger="ember_cupy.host"):
        _host._build("portable")
    assert "compiling the host kernels for portable" in logged_before_compiling[0]
    assert str(tmp_path) in logged_before_compiling[0]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_a_block_too_small_for_its_16_bit_scale_is_a_zero_block_like_the_twins(library, qtype):
    """Two passes: d = max|x| / 32512 of a block of ~1e-36 is subnormal and 1 / d overflows; the
    block counts as zero (q 0), in the kernel and the twin alike, and the row stays finite."""
    rng = np.random.default_rng(9)
    weight = _weight(rng, qtype, 16, 256)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    x[1, 32:64] *= np.float32(1e-36)
    two = ActivationQuantization(2, 0.0)
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(1) / (np.abs(x[1, 32:64]).max() / np.float32(32512)))
    assert (fake_quantize_activations(x, two)[1, 32:64] == 0).all()
    ours, twin = matmul_q(x, weight, library, two), matmul_q_numpy(x, weight, two)
    zeroed = x.copy()
    zeroed[1, 32:64] = 0.0
    np.testing.assert_array_equal(ours, matmul_q(zeroed, weight, library, two))
    np.testing.assert_allclose(ours, twin, rtol=2e-5, atol=2e-5 * np.abs(twin).max())
