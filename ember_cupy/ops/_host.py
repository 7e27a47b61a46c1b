"""Host kernels: cpu/*.c built for the path this CPU's features allow, loaded with ctypes (which
releases the GIL during a call). The CPU twin of ops/_cuda.py. An installed package carries them
prebuilt for every path of its architecture (ops/host_build.py, at `pip install`); a source
checkout, or a path the package lacks, compiles them on first use with the machine's C compiler,
cached on disk (keyed by source hash + flags + compiler version).

ISA paths: `avx512amx` (AVX-512 VNNI plus AMX tiles for matmuls of 12 int8 rows or more, where Linux
grants the tiles), `avx512vnni`, `avx2`; on aarch64 `neon-i8mm` (SMMLA), `neon-dotprod` (SDOT)
and `neon`; `portable` (plain C any compiler builds). `EMBER_HOST_ISA` forces one; `EMBER_HOST_KERNELS=0` turns host kernels off (the NumPy twins run instead);
`EMBER_NUM_THREADS` sets the kernels' thread count (default: the CPUs this process may use), and
`EMBER_SPIN_US` how long idle workers spin before sleeping (cpu/threadpool.h).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np

from ember_cupy.ops import host_build
from ember_cupy.ops._sources import kernel_source_dir
from ember_cupy.ops.host_build import ISA_FLAGS
from ember_cupy.ops.host_signatures import SIGNATURES

logger = logging.getLogger("ember_cupy.host")

_AVX512_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"}
ISA_CPU_FLAGS = {
    "avx512amx": _AVX512_CPU_FLAGS | {"amx_tile", "amx_int8"},
    "avx512vnni": _AVX512_CPU_FLAGS,
    "avx2": {"avx2", "fma", "f16c"},
    "neon-i8mm": {"asimd", "asimddp", "i8mm"},
    "neon-dotprod": {"asimd", "asimddp"},
    "neon": {"asimd"},
    "portable": set(),
}


class HostKernelError(RuntimeError):
    """The host kernels cannot be built or loaded here."""


class NoCompilerError(HostKernelError):
    """No C compiler to build the host kernels with: no ISA path can load, none is tried after
    the first. Expected on a machine without build tools, so `active()` leaves the warning to the
    model load, which knows what the NumPy path costs (ember_cupy/model/host_fallback.py)."""


HOST_SOURCE_DIR = kernel_source_dir("cpu", "EMBER_HOST_SOURCES")


def parse_cpu_flags(cpuinfo: str) -> set[str]:
    """The first processor's feature flags in a /proc/cpuinfo text: x86 lists them as `flags`,
    ARM as `Features`."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


# The aarch64 features the ARM paths need: their bits in Linux's AT_HWCAP / AT_HWCAP2 (asm/hwcap.h)
_AT_HWCAP, _AT_HWCAP2 = 16, 26
_ARM_HWCAPS = {"asimd": (_AT_HWCAP, 1 << 1), "asimddp": (_AT_HWCAP, 1 << 20), "i8mm": (_AT_HWCAP2, 1 << 13)}


def flags_from_hwcaps(hwcaps: dict[int, int]) -> set[str]:
    """The /proc/cpuinfo names of the ARM features set in these auxiliary-vector words."""
    return {name for name, (key, bit) in _ARM_HWCAPS.items() if hwcaps.get(key, 0) & bit}


def _auxv_hwcaps() -> dict[int, int]:
    """getauxval(AT_HWCAP) and getauxval(AT_HWCAP2) of this process (empty without getauxval)."""
    try:
        getauxval = ctypes.CDLL(None).getauxval
    except (OSError, AttributeError):
        return {}
    getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    return {key: getauxval(key) for key in (_AT_HWCAP, _AT_HWCAP2)}


def cpu_flags() -> set[str]:
    """The feature flags of this CPU as /proc/cpuinfo names them (empty where unreadable); on
    aarch64 also those the kernel reports in the auxiliary vector (a container may hide /proc)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = parse_cpu_flags(f.read())
    except OSError:
        flags = set()
    if platform.machine().lower() in ("aarch64", "arm64"):
        flags |= flags_from_hwcaps(_auxv_hwcaps())
    return flags


def best_isa(flags: set[str] | None = None) -> str:
    flags = cpu_flags() if flags is None else flags
    return next(isa for isa, needed in ISA_CPU_FLAGS.items() if needed <= flags)


def supported_isas() -> list[str]:
    flags = cpu_flags()
    return [isa for isa, needed in ISA_CPU_FLAGS.items() if needed <= flags]


def compiler() -> str | None:
    """$CC, else cc, gcc or clang on PATH; None when none of them is an executable."""
    chosen = os.environ.get("CC")
    if chosen:
        return shutil.which(chosen)
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _no_compiler_reason() -> str:
    chosen = os.environ.get("CC")
    return f"no C compiler: CC={chosen!r} is not an executable" if chosen else \
        "no C compiler (cc, gcc or clang) on PATH"


def _cache_dir() -> Path:
    return Path(os.environ.get("EMBER_KERNEL_CACHE", Path.home() / ".cache" / "ember_cupy" / "kernels"))


def _library_path(isa: str) -> tuple[Path, bool]:
    """The library for `isa` and whether the package carries it prebuilt (no compiler needed);
    else it is compiled here once (EMBER_HOST_PREBUILT=0 forces that)."""
    if os.environ.get("EMBER_HOST_PREBUILT", "1").strip().lower() not in ("0", "false", "no", "off"):
        prebuilt = host_build.prebuilt_library(HOST_SOURCE_DIR, isa)
        if prebuilt is not None:
            return prebuilt, True
    return _build(isa), False


def _build(isa: str) -> Path:
    """The kernel cache's library for `isa`, compiled by this machine's compiler on first use."""
    cc = compiler()
    if cc is None:
        raise NoCompilerError(_no_compiler_reason())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    digest = hashlib.sha256(f"{host_build.source_digest(HOST_SOURCE_DIR, isa)}|{version}".encode())
    target = _cache_dir() / host_build.library_name(isa, digest.hexdigest()[:20])
    if target.exists():
        return target
    logger.warning("compiling the host kernels for %s with %s (once: cached in %s; ~10-60 s)", isa, cc, target.parent)
    try:
        return host_build.compile_library(cc, isa, HOST_SOURCE_DIR, target)
    except host_build.CompileError as error:
        raise HostKernelError(str(error)) from None


class HostLibrary:
    """The loaded host kernels of one ISA path."""

    def __init__(self, isa: str):
        self.isa = isa
        self.path, self.prebuilt = _library_path(isa)
        self.lib = ctypes.CDLL(str(self.path))
        self._declare()
        threads = int(os.environ.get("EMBER_NUM_THREADS", 0)) or _usable_cpus()
        self.lib.ember_set_num_threads(threads)
        self.threads = self.lib.ember_max_threads()
        built_isa = self.lib.ember_isa().decode()
        if built_isa != isa:
            raise HostKernelError(f"host kernels built for {isa} report {built_isa}: flags not honoured")
        if isa == "avx512amx" and not self.lib.ember_amx_ready():
            raise HostKernelError("the kernel refused this process the AMX tile registers (arch_prctl)")

    def _declare(self):
        """Every entry point's ctypes signature (ops/host_signatures.py); a library built before
        an entry point existed simply lacks it."""
        for name, (argtypes, restype) in SIGNATURES.items():
            function = getattr(self.lib, name, None)
            if function is not None:
                function.argtypes, function.restype = argtypes, restype

    def describe(self) -> str:
        built = "prebuilt with the package" if self.prebuilt else compiler()
        return f"host kernels: {self.isa}, {self.threads} thread(s), {built}"


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=None)
def load_library(isa: str | None = None) -> HostLibrary:
    """The host kernels for `isa` (default: EMBER_HOST_ISA, else the best this CPU supports)."""
    isa = isa or os.environ.get("EMBER_HOST_ISA")
    if isa is None:
        return _best_loadable()
    if isa not in ISA_FLAGS:
        raise HostKernelError(f"EMBER_HOST_ISA={isa!r} is not one of {sorted(ISA_FLAGS)}")
    if isa not in supported_isas() and isa != "portable":
        raise HostKernelError(f"this CPU lacks the features of the {isa} path")
    return HostLibrary(isa)


def _best_loadable() -> HostLibrary:
    """The first path this CPU supports that loads (AMX may be refused by the OS: then AVX-512)."""
    *better, last = supported_isas()
    for isa in better:
        try:
            return HostLibrary(isa)
        except NoCompilerError:
            raise
        except HostKernelError as error:
            logger.warning("host kernels: %s path unavailable (%s), trying the next", isa, error)
    return HostLibrary(last)


@functools.lru_cache(maxsize=None)
def active() -> HostLibrary | None:
    """The host kernels the ops use, or None (then the NumPy twins run): off by EMBER_HOST_KERNELS=0,
    or unavailable here (`unavailable()` says why; a one-line warning too, but for a missing
    compiler, which the model load reports once with its memory cost)."""
    global _unavailable
    _unavailable = None
    if os.environ.get("EMBER_HOST_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        library = load_library()
    except (HostKernelError, OSError) as error:
        _unavailable = error
        first_line = str(error).strip().split("\n")[0]
        log = logger.info if isinstance(error, NoCompilerError) else logger.warning
        log("host kernels unavailable, using the NumPy path (slow): %s", first_line)
        return None
    return library


_unavailable: Exception | None = None


def unavailable() -> Exception | None:
    """Why the host kernels could not load here; None when they did, or are off by choice."""
    active()
    return _unavailable


def rows_f32(*arrays) -> bool:
    """True when every array is float32 with a dense last axis (and 2-D arrays step whole rows)."""
    return all(isinstance(a, np.ndarray) and a.dtype == np.float32 and a.strides[-1] == 4
               and (a.ndim == 1 or (a.ndim == 2 and a.strides[0] % 4 == 0)) for a in arrays)


def row_stride(array) -> int:
    return array.strides[0] // 4


def describe() -> str:
    library = active()
    return library.describe() if library else "host kernels: off (NumPy twins)"
