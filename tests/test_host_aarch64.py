"""The aarch64 host kernel paths without ARM hardware: cpu/*.c cross-compiled with each aarch64
path's flags into a static program (tests/host_emulated/driver.c) run under qemu-user, on inputs
written here. The quantized matmul (matrices of every format) must give the native library's
bits (the NEON paths' integer sums are exact and their float steps the portable path's); paged
attention, RMSNorm and SiLU/GELU-tanh x up, NEON on the NEON paths, the native 256-bit (avx2)
library's, plain C on the portable path the native portable library's; RoPE plain C; the sampling
helpers the twins' exactly; all near the NumPy twins. qemu's
`-cpu max` has SMMLA and SDOT, `-cpu cortex-a76` SDOT only, `-cpu cortex-a53` plain NEON only:
an instruction that leaked into a path whose CPUs lack it would trap."""
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ember_cupy import ops
from ember_cupy.engine.sampler import argmax_ignoring_nan_numpy, kth_largest_numpy
from ember_cupy.half_weight import pack_16bit
from ember_cupy.ops import _host, activation, host_build, norm, rotary
from ember_cupy.ops.attention import paged_attention_host
from ember_cupy.ops.linear import matmul_q, matmul_q_numpy
from ember_cupy.ops.rotary import rope_cos_sin_cache
from ember_cupy.packed_weight import LAYOUTS, to_kernel_format
from ember_cupy.quant import ActivationQuantization, QuantizedTensor
from ember_cupy.structured.bitmask import apply_token_bitmask_numpy
from tests.test_host_attention import assert_near_twin, make_batch
from tests.test_host_kernels import _K_QUANT_SCALES, _weight

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
DRIVER = Path(__file__).parent / "host_emulated" / "driver.c"
QEMU_CPU = {"portable": "cortex-a53", "neon": "cortex-a53", "neon-dotprod": "cortex-a76", "neon-i8mm": "max"}
AARCH64_ISAS = host_build.machine_isas("aarch64")

pytestmark = pytest.mark.skipif(
    not (shutil.which(CROSS_CC) and shutil.which(QEMU)),
    reason=f"needs {CROSS_CC} and {QEMU} (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)")

N = 13                                            # a whole group of 8 rows and a padded one
SHAPES = [(1, 1), (1, 8), (1, 31), (2, 5), (2, 13)]   # (passes, M): tiles of 8 int8 rows and their tails


def _columns(qtype):
    return (256, 2304) if qtype in _K_QUANT_SCALES else (32, 96, 2080)


@pytest.fixture(scope="module")
def native():
    if _host.unavailable() is not None:
        pytest.skip(f"no native host kernels to compare with: {_host.unavailable()}")
    return _host.active()


@pytest.fixture(scope="module")
def drivers(tmp_path_factory):
    """The driver built for each aarch64 path (about 5 s each)."""
    out = tmp_path_factory.mktemp("aarch64")
    built = {}
    for isa in AARCH64_ISAS:
        flags = [f for f in host_build.flags(isa) if f not in ("-shared", "-fPIC")]
        built[isa] = out / f"matmul-{isa}"
        subprocess.run([CROSS_CC, *flags, "-static", "-I", str(_host.HOST_SOURCE_DIR),
                        *map(str, host_build.sources(_host.HOST_SOURCE_DIR)), str(DRIVER), "-o", str(built[isa]),
                        "-lm"], check=True, capture_output=True, text=True)
    return built


def _matmul_cases():
    """(x, weight, scheme) for every format, odd shapes, zero and non-finite blocks of x."""
    rng = np.random.default_rng(29)
    cases = []
    for qtype in LAYOUTS:
        for K in _columns(qtype):
            weight = _weight(rng, qtype, N, K)
            for passes, M in SHAPES:
                x = rng.standard_normal((M, K)).astype(np.float32) * rng.uniform(0.1, 9, (1, K)).astype(np.float32)
                x[M // 2, :32] = 0.0                      # a zero block: skipped
                cases.append((x, weight, ActivationQuantization(passes, 0.5)))
        x = rng.standard_normal((4, K)).astype(np.float32)
        x[0, 3], x[1, 5], x[2, 7], x[3, 9] = np.inf, -np.inf, np.nan, 3e38   # non-finite and overflowing blocks
        cases.append((x, weight, ActivationQuantization(1, 0.5)))
    cases.append(_extreme_q8_0_case())
    return cases + _half_cases(rng)


def _half_cases(rng):
    """16-bit float matrices (cpu/matmul_16bit.c: x not quantized, one FMA chain per output)."""
    cases = []
    for qtype, dtype in (("F16", np.float16), ("BF16", None)):
        for K in (96, 2080):
            values = rng.standard_normal((N, K)).astype(np.float32)
            bits = values.astype(dtype).view(np.uint16) if dtype else (values.view(np.uint32) >> 16).astype(np.uint16)
            weight = pack_16bit(QuantizedTensor(qtype, bits.view(np.uint8), (N, K)))
            for M in (1, 8, 31):
                cases.append((rng.standard_normal((M, K)).astype(np.float32), weight, ActivationQuantization(1, 0.5)))
    return cases


def _extreme_q8_0_case():
    """Q8_0 weights all -128 against x quantized to +-127: the plain NEON path's 16-bit sums of two
    products at their largest (2 x 128 x 127)."""
    blocks = np.zeros((N, 3, 34), np.uint8)
    blocks[..., :2] = np.array([0.01], np.float16).view(np.uint8)
    blocks[..., 2:] = np.uint8(128)                                  # int8 -128
    weight = to_kernel_format(QuantizedTensor("Q8_0", blocks.reshape(N, -1), (N, 96)))
    x = np.where(np.arange(96) % 3 == 0, -1.0, 1.0).astype(np.float32)[None].repeat(2, axis=0)
    return x, weight, ActivationQuantization(1, 0.5)


ATTENTION_SEQS = [(1, 1), (150, 1), (40, 40), (300, 17)]   # a decode, a split decode, a prompt, a chunk


def _attention_cases():
    """(args, clean tables, window) of paged_attention_host: head_dim 64/80/128/256, f32 and f16
    pages, a sliding window, a NaN key."""
    rng = np.random.default_rng(29)
    cases = []
    for head_dim in (64, 80, 128, 256):
        for dtype in (np.float32, np.float16):
            args, clean = make_batch(rng, ATTENTION_SEQS, num_kv_heads=2, group=2, head_dim=head_dim, dtype=dtype)
            cases.append(((np.ascontiguousarray(args[0]), *args[1:]), clean, 0))
    args, clean = make_batch(rng, ATTENTION_SEQS, num_kv_heads=2, group=2, head_dim=64)
    cases.append(((np.ascontiguousarray(args[0]), *args[1:]), clean, 20))
    k_cache = args[1].copy()
    k_cache[clean[1, 2], 5, 0, 7] = np.nan                    # key 37 of the second sequence
    cases.append(((np.ascontiguousarray(args[0]), k_cache, *args[2:]), clean, 0))
    return cases


ROW_OPS = {"rms_norm": 0, "silu_and_mul": 1, "gelu_tanh_and_mul": 2}


def _row_cases():
    """(op, x, weight) of the row kernels: odd widths (the tails), extreme gates."""
    rng = np.random.default_rng(29)
    cases = [("rms_norm", (rng.standard_normal((rows, 576)) * 3).astype(np.float32),
              rng.standard_normal(576).astype(np.float32)) for rows in (1, 9)]
    for op in ("silu_and_mul", "gelu_tanh_and_mul"):
        gate_up = (rng.standard_normal((5, 2 * 1539)) * 6).astype(np.float32)
        gate_up[0, :8] = [-100.0, 100.0, 0.0, -0.0, -9.0, 9.0, 1e20, -1e20]
        cases.append((op, gate_up, None))
    return cases


def _rope_cases():
    """(q, k, positions, cos_sin cache, neox): head_dim 64 and 128, both rotation layouts."""
    rng = np.random.default_rng(29)
    cases = []
    for head_dim in (64, 128):
        cache = rope_cos_sin_cache(head_dim, 4096, 1e5)
        for neox in (True, False):
            q = rng.standard_normal((7, 6, head_dim)).astype(np.float32)
            k = rng.standard_normal((7, 2, head_dim)).astype(np.float32)
            cases.append((q, k, rng.integers(0, 4096, 7).astype(np.int32), cache, neox))
    return cases


def _sampling_cases():
    """("kth", logits, ks) with ties and -inf; ("bitmask", logits, mask) with a mask narrower than
    the vocabulary, an all-clear word and a partial last word."""
    rng = np.random.default_rng(29)
    logits = rng.standard_normal((5, 5000)).astype(np.float32)
    logits[:, ::7] = 1.5
    logits[0, :3] = -np.inf
    mask = rng.integers(-2**31, 2**31, (5, 150), dtype=np.int64).astype(np.int32)   # 4800 < 5000 tokens
    mask[1, 10] = 0
    greedy = logits[:, :4097].copy()     # an odd width, ties (the 1.5s), NaN first, +inf, a row of NaN and -inf
    greedy[1, 0], greedy[2, 100], greedy[3, :], greedy[3, -1] = np.nan, np.inf, np.nan, -np.inf
    return [("kth", logits, np.array([1, 7, 256, 4999, 5000], np.int64)), ("bitmask", logits, mask),
            ("argmax", greedy, np.zeros((5, 0), np.int32))]


CASES = {"matmul": _matmul_cases(), "attention": _attention_cases(), "rows": _row_cases(), "rope": _rope_cases(),
         "sampling": _sampling_cases()}


def _write_matmul(f, x, weight, scheme):
    data = np.ascontiguousarray(weight.data)
    np.array([0, *x.shape, N, weight.kernel_type, scheme.passes, data.nbytes], np.int64).tofile(f)
    np.array([scheme.second_pass_threshold], np.float32).tofile(f)
    x.tofile(f)
    data.tofile(f)


def _write_attention(f, args, clean, window):
    q, k_cache, v_cache, tables, context_lens, query_start_loc, scale = args
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    np.array([1, q.shape[0], q.shape[1], num_kv_heads, head_dim, num_blocks, block_size,
              k_cache.dtype == np.float16, len(context_lens), tables.shape[1], window], np.int64).tofile(f)
    np.array([scale], np.float32).tofile(f)
    for array in (q, k_cache, v_cache, tables.astype(np.int32), context_lens.astype(np.int32),
                  query_start_loc.astype(np.int32)):
        np.ascontiguousarray(array).tofile(f)


def _write_rows(f, op, x, weight):
    np.array([2, ROW_OPS[op], *x.shape], np.int64).tofile(f)
    np.array([1e-5], np.float32).tofile(f)
    x.tofile(f)
    if weight is not None:
        weight.tofile(f)


def _write_rope(f, q, k, positions, cache, neox):
    np.array([3, q.shape[0], q.shape[1], k.shape[1], q.shape[2], len(cache), neox], np.int64).tofile(f)
    for array in (q, k, positions, cache):
        np.ascontiguousarray(array).tofile(f)


SAMPLING_OPS = {"kth": 0, "bitmask": 1, "argmax": 2}


def _write_sampling(f, op, logits, extra):
    words = extra.shape[1] if op == "bitmask" else 0
    np.array([4, SAMPLING_OPS[op], *logits.shape, words], np.int64).tofile(f)
    logits.tofile(f)
    np.ascontiguousarray(extra).tofile(f)


WRITERS = {"matmul": _write_matmul, "attention": _write_attention, "rows": _write_rows, "rope": _write_rope,
           "sampling": _write_sampling}


def _emulated(driver, isa, tmp_path):
    """The driver's outputs, per family of CASES: each case's floats, flat."""
    with open(tmp_path / "cases.bin", "wb") as f:
        for family, cases in CASES.items():
            for case in cases:
                WRITERS[family](f, *case)
    result = subprocess.run([QEMU, "-cpu", QEMU_CPU[isa], str(driver), str(tmp_path / "cases.bin"),
                             str(tmp_path / "out.bin")], capture_output=True, text=True, timeout=300,
                            env={"EMBER_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [isa, str(sum(map(len, CASES.values())))]
    flat = np.fromfile(tmp_path / "out.bin", np.float32)
    outputs, at = {}, 0
    for family, cases in CASES.items():
        outputs[family] = []
        for case in cases:
            size = _output_size(family, case)
            outputs[family].append(flat[at:at + size])
            at += size
    assert at == flat.size
    return outputs


def _output_size(family, case):
    if family == "matmul":
        return case[0].shape[0] * N
    if family == "attention":
        return case[0][0].size
    if family == "rows":
        return case[1].size if case[0] == "rms_norm" else case[1].size // 2
    if family == "sampling":
        return case[1].size if case[0] == "bitmask" else case[1].shape[0]
    return case[0].size + case[1].size


@pytest.fixture(scope="module")
def outputs(drivers, tmp_path_factory):
    return {isa: _emulated(drivers[isa], isa, tmp_path_factory.mktemp(isa)) for isa in AARCH64_ISAS}


@pytest.fixture(scope="module")
def portable_ops():
    """The public ops (ember_cupy.ops) on the native portable library."""
    if _host.unavailable() is not None:
        pytest.skip(f"no native host kernels to compare with: {_host.unavailable()}")
    with pytest.MonkeyPatch.context() as patch:
        library = _host.load_library("portable")
        patch.setattr(_host, "active", lambda: library)
        yield library


def _native_rows(op, x, weight):
    return ops.rms_norm(x, weight, 1e-5) if op == "rms_norm" else getattr(ops, op)(x)


def _twin_rows(op, x, weight):
    with np.errstate(over="ignore"):
        return norm.rms_norm_numpy(x, weight, 1e-5) if op == "rms_norm" else getattr(activation, f"{op}_numpy")(x)


def _rotated(apply, q, k, positions, cache, neox):
    q, k = q.copy(), k.copy()
    apply(q, k, positions, cache, is_neox=neox)
    return np.concatenate([q.ravel(), k.ravel()])


@pytest.mark.parametrize("isa", AARCH64_ISAS)
def test_every_aarch64_matmul_is_the_native_library_bit_for_bit(outputs, native, isa):
    for (x, weight, scheme), ours in zip(CASES["matmul"], outputs[isa]["matmul"]):
        expected = matmul_q(x, weight, native, scheme)
        np.testing.assert_array_equal(ours.reshape(expected.shape), expected,
                                      err_msg=f"{isa}: {weight.qtype} x {x.shape} passes {scheme.passes}")


@pytest.mark.parametrize("isa", AARCH64_ISAS)
def test_every_aarch64_matmul_is_near_the_numpy_twin(outputs, isa):
    for (x, weight, scheme), ours in zip(CASES["matmul"], outputs[isa]["matmul"]):
        if not np.isfinite(x).all():
            continue
        twin = matmul_q_numpy(x, weight, scheme)
        np.testing.assert_allclose(ours.reshape(twin.shape), twin, rtol=2e-5, atol=2e-5 * np.abs(twin).max(),
                                   err_msg=f"{isa}: {weight.qtype} x {x.shape} passes {scheme.passes}")


@pytest.mark.parametrize("isa", AARCH64_ISAS)
def test_every_aarch64_attention_is_the_native_library_bit_for_bit(outputs, native, isa):
    """The NEON paths take the x86 AVX2 path's steps (head_dim a multiple of 8), plain C portable's."""
    reference = _host.load_library("portable") if isa == "portable" else _native_library("avx2")
    for (args, _, window), ours in zip(CASES["attention"], outputs[isa]["attention"]):
        expected = paged_attention_host(*args, library=reference, window=window)
        np.testing.assert_array_equal(ours.reshape(expected.shape), expected,
                                      err_msg=f"{isa}: {args[1].dtype} {args[1].shape} window {window}")


@pytest.mark.parametrize("isa", AARCH64_ISAS)
def test_every_aarch64_attention_is_near_the_numpy_twin(outputs, isa):
    for (args, clean, window), ours in zip(CASES["attention"], outputs[isa]["attention"]):
        with np.errstate(invalid="ignore", over="ignore"):      # the NaN key's case
            assert_near_twin(ours.reshape(args[0].shape), args, clean, args[1].dtype, window)


@pytest.mark.parametrize("isa", AARCH64_ISAS)
def test_every_aarch64_row_kernel_and_rope_is_the_native_library_bit_for_bit(outputs, portable_ops, isa):
    """RMSNorm and SiLU/GELU-tanh x up: the NEON paths take the x86 256-bit path's steps (its exp
    polynomial, its 8 lanes), plain C the portable library's; RoPE is plain C everywhere."""
    reference = portable_ops if isa == "portable" else _native_library("avx2")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_host, "active", lambda: reference)
        for (op, x, weight), ours in zip(CASES["rows"], outputs[isa]["rows"]):
            expected = _native_rows(op, x, weight)
            np.testing.assert_array_equal(ours.reshape(expected.shape), expected, err_msg=f"{isa}: {op}")
    for case, ours in zip(CASES["rope"], outputs[isa]["rope"]):
        np.testing.assert_array_equal(ours, _rotated(ops.apply_rope, *case), err_msg=f"{isa}: rope")


def _native_library(isa: str):
    if isa not in _host.supported_isas():
        pytest.skip(f"this machine does not run the {isa} path the NEON row kernels are held to")
    return _host.load_library(isa)


@pytest.mark.parametrize("isa", AARCH64_ISAS)
def test_every_aarch64_row_kernel_and_rope_is_near_the_numpy_twin(outputs, isa):
    for (op, x, weight), ours in zip(CASES["rows"], outputs[isa]["rows"]):
        twin = _twin_rows(op, x, weight)
        np.testing.assert_allclose(ours.reshape(twin.shape), twin, rtol=1e-5, atol=1e-5, err_msg=f"{isa}: {op}")
    for case, ours in zip(CASES["rope"], outputs[isa]["rope"]):
        np.testing.assert_array_equal(ours, _rotated(rotary.apply_rope_numpy, *case), err_msg=f"{isa}: rope")


def test_each_arm_path_has_only_its_own_instructions(drivers):
    """Run on a Cortex-A53 (no dotprod) and an A76 (no i8mm) above; here the proof is in the code."""
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if not objdump:
        pytest.skip("needs aarch64-linux-gnu-objdump")
    code = {isa: subprocess.run([objdump, "-d", str(drivers[isa])], capture_output=True, text=True, check=True).stdout
            for isa in ("neon", "neon-dotprod", "neon-i8mm")}
    assert "\tsdot\t" not in code["neon"] and "\tsdot\t" in code["neon-dotprod"]
    assert "\tsmmla\t" not in code["neon-dotprod"] and "\tsmmla\t" in code["neon-i8mm"]


@pytest.mark.parametrize("isa", AARCH64_ISAS)
def test_every_aarch64_sampling_helper_is_the_twin_exactly(outputs, isa):
    """Selections and masks, no arithmetic: exactly the twins' (and so the native kernels') values."""
    (_, logits, ks), (_, masked_logits, mask), (_, greedy, _) = CASES["sampling"]
    kth, masked, argmax = outputs[isa]["sampling"]
    np.testing.assert_array_equal(kth, kth_largest_numpy(logits, list(ks)))
    np.testing.assert_array_equal(argmax, argmax_ignoring_nan_numpy(greedy))
    twin = masked_logits.copy()
    apply_token_bitmask_numpy(twin, mask, np.arange(len(twin)))
    np.testing.assert_array_equal(masked.reshape(twin.shape), twin)
