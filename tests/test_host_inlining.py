"""The quantized matmul's per-block helpers are inlined into its loops in the built libraries.

gcc's inliner gave up on some of them (decode_values16 for Q5_K, Q5_0 and Q6_K, the 256-bit
dot4_values8, every helper of the NEON paths): each 32-column block then paid a call and its
eight decoded vectors went through memory. A one-row Q5_K matmul ran at 21 GB/s from the caches
against 58 GB/s inlined (tools/bench_matmul.py --shape llama-1b --formats Q5_K --rows 1). The
helpers are marked always_inline; this holds the libraries to it, on the paths this machine
builds (AMX's too, where the CPU lacks it) and, where a cross compiler is installed, the
aarch64 ones."""
import shutil
import subprocess
from pathlib import Path

import pytest

from ember_cupy.ops import _host, host_build

PER_BLOCK_HELPERS = {
    "decode_values8", "decode_values16", "dot4_values8", "dot4_values16", "dot4_rows8", "dot4_rows16",
    "record_of", "body_of", "x_from",                                             # x86 and shared
    "decode_values", "dot4_values", "block_scales", "accumulate_row", "values_by_row_pairs",
    "dot_values_pair", "block_sum", "split_combine", "products2", "bcast4",      # NEON
}
CROSS_CC = "aarch64-linux-gnu-gcc"

pytestmark = pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")


def local_functions(library: Path) -> set[str]:
    """The library's local function symbols, without gcc's clone suffixes (.constprop.0, .isra.0)."""
    listing = subprocess.run(["nm", str(library)], capture_output=True, text=True, check=True).stdout
    rows = (line.split() for line in listing.splitlines())
    return {fields[2].split(".")[0] for fields in rows if len(fields) == 3 and fields[1] == "t"}


def compiled_matmul(cc: str, isa: str, out_dir: Path) -> Path:
    """cpu/matmul_q.c alone, compiled as the library compiles it for `isa` (an object file: the
    helpers are local to it; ~15 s a path)."""
    source_dir = _host.HOST_SOURCE_DIR
    target = out_dir / f"matmul_q-{isa}.o"
    subprocess.run([cc, *host_build.flags(isa), "-I", str(source_dir), "-c", str(source_dir / "matmul_q.c"),
                    "-o", str(target)], check=True)
    return target


NATIVE_PATHS = [isa for isa in host_build.machine_isas() if isa != "portable"]


@pytest.mark.parametrize("isa", NATIVE_PATHS)
def test_this_architectures_paths_inline_the_per_block_helpers(isa, tmp_path):
    """The library this machine loads for `isa`; a path its CPU lacks (AMX on a CPU without it) is
    compiled here, as the package's prebuilt libraries are."""
    if isa in _host.supported_isas():
        if _host.unavailable() is not None:
            pytest.skip(f"no native host kernels: {_host.unavailable()}")
        built = _host.load_library(isa).path
    else:
        cc = _host.compiler()
        if cc is None:
            pytest.skip("no C compiler")
        built = compiled_matmul(cc, isa, tmp_path)
    assert local_functions(built) & PER_BLOCK_HELPERS == set(), built


@pytest.mark.skipif(shutil.which(CROSS_CC) is None, reason=f"needs {CROSS_CC}")
@pytest.mark.parametrize("isa", [isa for isa in host_build.machine_isas("aarch64") if isa != "portable"])
def test_aarch64_paths_inline_the_per_block_helpers(isa, tmp_path):
    assert local_functions(compiled_matmul(CROSS_CC, isa, tmp_path)) & PER_BLOCK_HELPERS == set(), isa
