"""How the host kernels (cpu/*.c) are compiled, for each ISA path: at `pip install` into the
package (setup.py imports this file by path, so it uses the standard library only), and at first
use into the kernel cache when the package holds no library for this CPU's path (a source
checkout, an unknown CPU). ops/_host.py chooses the path and loads the library.

A prebuilt library is named by the digest of the sources and flags it was built from, so an
edited checkout never loads a stale one."""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
from pathlib import Path

logger = logging.getLogger("ember_cupy.host")

# -mavx512bf16 lets the bf16 prompt path (cpu/matmul_bf16.h) be compiled in; it runs only where
# CPUID reports AVX512-BF16 (no other code is written with bf16 types, so the compiler emits none).
# A compiler that does not know it (GCC < 10) builds the path without it (OPTIONAL_FLAGS).
OPTIONAL_FLAGS = ("-mavx512bf16",)
_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mavx2", "-mfma",
                 "-mf16c")
ISA_FLAGS = {
    "avx512amx": (*_AVX512_FLAGS, "-mamx-tile", "-mamx-int8", "-mamx-bf16"),
    "avx512vnni": _AVX512_FLAGS,
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    # aarch64 always has NEON, so its paths are asked for by name: "portable" stays plain C there
    "neon-i8mm": ("-march=armv8.2-a+dotprod+i8mm", "-DEMBER_USE_NEON"),
    "neon-dotprod": ("-march=armv8.2-a+dotprod", "-DEMBER_USE_NEON"),
    "neon": ("-march=armv8-a", "-DEMBER_USE_NEON"),
    "portable": (),
}
BASE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off",
              "-fno-math-errno", "-Wall", "-Wextra", "-fvisibility=hidden")

# The paths a package built on this architecture carries (platform.machine() names).
ISAS_BY_MACHINE = {
    "x86_64": ("avx512amx", "avx512vnni", "avx2", "portable"),
    "amd64": ("avx512amx", "avx512vnni", "avx2", "portable"),
    "aarch64": ("neon-i8mm", "neon-dotprod", "neon", "portable"),
    "arm64": ("neon-i8mm", "neon-dotprod", "neon", "portable"),
}

PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"


class CompileError(RuntimeError):
    """The compiler failed on the host kernels; the message holds the end of its output."""


def flags(isa: str) -> tuple[str, ...]:
    return (*BASE_FLAGS, *ISA_FLAGS[isa])


def machine_isas(machine: str | None = None) -> tuple[str, ...]:
    return ISAS_BY_MACHINE.get((machine or platform.machine()).lower(), ("portable",))


def sources(source_dir: Path) -> list[Path]:
    return sorted(Path(source_dir).glob("*.c"))


def source_digest(source_dir: Path, isa: str) -> str:
    """Of every source and header, and the ISA's flags: what a library's bits depend on, but
    for the compiler (the kernel cache adds its version; a prebuilt library is the package's)."""
    digest = hashlib.sha256()
    for path in [*sources(source_dir), *sorted(Path(source_dir).glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(flags(isa)).encode())
    return digest.hexdigest()[:20]


def library_name(isa: str, digest: str) -> str:
    return f"ember_host-{isa}-{digest}.so"


def prebuilt_library(source_dir: Path, isa: str, prebuilt_dir: Path = PREBUILT_DIR) -> Path | None:
    """The package's library for `isa` built from exactly these sources, or None."""
    path = Path(prebuilt_dir) / library_name(isa, source_digest(source_dir, isa))
    return path if path.is_file() else None


def compile_library(cc: str, isa: str, source_dir: Path, target: Path) -> Path:
    """cpu/*.c as one shared library at `target` (written whole or not at all)."""
    source_files = sources(source_dir)
    if not source_files:
        raise CompileError(f"no host kernel sources in {source_dir}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    errors = ""
    every_flag = flags(isa)
    for isa_flags in dict.fromkeys((every_flag, tuple(f for f in every_flag if f not in OPTIONAL_FLAGS))):
        for openmp in (("-fopenmp",), ()):   # a compiler without OpenMP still builds 1-thread kernels
            cmd = [cc, *isa_flags, *openmp, "-I", str(source_dir), *map(str, source_files), "-o", str(tmp), "-lm"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode == 0:
                os.replace(tmp, target)
                return target
            errors = result.stderr
    raise CompileError(f"{cc} failed to build the host kernels ({isa}):\n{errors[-4000:]}")


def prebuild(cc: str, source_dir: Path, out_dir: Path, isas: tuple[str, ...]) -> list[Path]:
    """Every path in `isas` into `out_dir` (the package build); a path this compiler cannot build
    is left out with a warning: the installed package then compiles it at first use, if it can."""
    built = []
    for isa in isas:
        target = Path(out_dir) / library_name(isa, source_digest(source_dir, isa))
        try:
            built.append(compile_library(cc, isa, source_dir, target))
        except CompileError as error:
            logger.warning("host kernels: %s left out of the package: %s", isa, str(error).splitlines()[0])
    return built
