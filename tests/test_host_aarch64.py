"""The aarch64 host kernel paths without ARM hardware: cpu/*.c cross-compiled with each aarch64
path's flags into a static program (tests/host_emulated/matmul_driver.c) run under qemu-user, on
matrices of every format packed here; its outputs must be the native library's bit for bit (the
NEON paths' integer sums are exact and their float steps the portable path's), and near the
NumPy twin. qemu's `-cpu max` has SDOT; `-cpu cortex-a53` has plain NEON only, so it would trap
an SDOT that leaked into the neon path."""
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ember_cupy.ops import _host, host_build
from ember_cupy.ops.linear import matmul_q, matmul_q_numpy
from ember_cupy.packed_weight import LAYOUTS
from ember_cupy.quant import ActivationQuantization
from tests.test_host_kernels import _K_QUANT_SCALES, _weight

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
DRIVER = Path(__file__).parent / "host_emulated" / "matmul_driver.c"
QEMU_CPU = {"portable": "cortex-a53", "neon": "cortex-a53", "neon-dotprod": "max"}
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


def _cases():
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
        x = rng.standard_normal((3, K)).astype(np.float32)
        x[0, 3], x[1, 5], x[2, 7] = np.inf, -np.inf, 3e38         # overflowing and infinite blocks
        cases.append((x, weight, ActivationQuantization(1, 0.5)))
    return cases


CASES = _cases()


def _write_cases(path, cases):
    with open(path, "wb") as f:
        for x, weight, scheme in cases:
            data = np.ascontiguousarray(weight.data)
            np.array([*x.shape, N, weight.kernel_type, scheme.passes, data.nbytes], np.int64).tofile(f)
            np.array([scheme.second_pass_threshold], np.float32).tofile(f)
            x.tofile(f)
            data.tofile(f)


def _emulated(driver, isa, cases, tmp_path):
    _write_cases(tmp_path / "cases.bin", cases)
    result = subprocess.run([QEMU, "-cpu", QEMU_CPU[isa], str(driver), str(tmp_path / "cases.bin"),
                             str(tmp_path / "y.bin")], capture_output=True, text=True, timeout=300,
                            env={"EMBER_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [isa, str(len(cases))]
    y = np.fromfile(tmp_path / "y.bin", np.float32)
    sizes = np.cumsum([x.shape[0] * N for x, _, _ in cases])
    return [part.reshape(-1, N) for part in np.split(y, sizes[:-1])]


@pytest.fixture(scope="module")
def outputs(drivers, tmp_path_factory):
    return {isa: _emulated(drivers[isa], isa, CASES, tmp_path_factory.mktemp(isa)) for isa in AARCH64_ISAS}


@pytest.mark.parametrize("isa", AARCH64_ISAS)
def test_every_aarch64_path_is_the_native_library_bit_for_bit(outputs, native, isa):
    for (x, weight, scheme), ours in zip(CASES, outputs[isa]):
        expected = matmul_q(x, weight, native, scheme)
        np.testing.assert_array_equal(ours, expected, err_msg=f"{isa}: {weight.qtype} x {x.shape} passes {scheme.passes}")


@pytest.mark.parametrize("isa", AARCH64_ISAS)
def test_every_aarch64_path_is_near_the_numpy_twin(outputs, isa):
    for (x, weight, scheme), ours in zip(CASES, outputs[isa]):
        if not np.isfinite(x).all():
            continue
        twin = matmul_q_numpy(x, weight, scheme)
        np.testing.assert_allclose(ours, twin, rtol=2e-5, atol=2e-5 * np.abs(twin).max(),
                                   err_msg=f"{isa}: {weight.qtype} x {x.shape} passes {scheme.passes}")


def test_the_plain_neon_path_has_no_sdot(drivers):
    """Run on a Cortex-A53 (no dotprod) above; here the proof is in the code: no SDOT at all."""
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if not objdump:
        pytest.skip("needs aarch64-linux-gnu-objdump")
    code = {isa: subprocess.run([objdump, "-d", str(drivers[isa])], capture_output=True, text=True, check=True).stdout
            for isa in ("neon", "neon-dotprod")}
    assert "\tsdot\t" not in code["neon"] and "\tsdot\t" in code["neon-dotprod"]
