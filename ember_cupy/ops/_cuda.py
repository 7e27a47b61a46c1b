"""Kernel loading for ops/: cuda/*.cu compiled once by NVRTC into a CUBIN (disk cache keyed by source
hash + arch + options + NVRTC version) and loaded as a cupy.RawModule.

`function(source, name)` returns a launchable kernel with RawKernel's call shape. Tests may install
another provider (the CPU shim in tests/kernels/shim) with `use_provider`; while one is installed,
every op dispatches to its kernel even for NumPy arrays.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path

import numpy as np

from ember_cupy.ops._sources import kernel_source_dir

CUDA_SOURCE_DIR = kernel_source_dir("cuda", "EMBER_CUDA_SOURCES")
NVRTC_OPTIONS = ("-std=c++17",)

_provider = None
_modules: dict[tuple[str, str], object] = {}


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message carries the program log."""


# --- dispatch -------------------------------------------------------------------------------
def wants_kernel(array) -> bool:
    """True when an op on `array` must launch its kernel: a CuPy array, or a provider installed."""
    return _provider is not None or not isinstance(array, np.ndarray)


@contextlib.contextmanager
def use_provider(provider):
    """Route every op to its kernel through `provider.function(source, name)` (tests only)."""
    global _provider
    previous, _provider = _provider, provider
    try:
        yield provider
    finally:
        _provider = previous


def function(source: str, name: str):
    """The kernel `name` of cuda/`source`, callable as fn(grid, block, args, shared_mem=)."""
    if _provider is not None:
        return _provider.function(source, name)
    import cupy
    arch = cupy.cuda.Device().compute_capability
    key = (source, arch)
    if key not in _modules:
        _modules[key] = cupy.RawModule(path=str(compile_cubin(source, arch)))
    return _modules[key].get_function(name)


# --- NVRTC ----------------------------------------------------------------------------------
def cuda_include_dir() -> Path:
    """A directory holding cuda_fp16.h; NVRTC does not find it by itself with pip-installed CUDA."""
    candidates = [os.environ.get("EMBER_CUDA_INCLUDE")]
    candidates += [os.path.join(os.environ[v], "include") for v in ("CUDA_PATH", "CUDA_HOME") if v in os.environ]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(nvcc)), "include"))
    candidates.append("/usr/local/cuda/include")
    with contextlib.suppress(ImportError):
        import nvidia.cuda_runtime  # pip wheel nvidia-cuda-runtime-cu12
        candidates += [os.path.join(p, "include") for p in nvidia.cuda_runtime.__path__]
    for candidate in filter(None, candidates):
        if os.path.isfile(os.path.join(candidate, "cuda_fp16.h")):
            return Path(candidate)
    raise FileNotFoundError("cuda_fp16.h not found: set EMBER_CUDA_INCLUDE to the CUDA include directory")


def _cache_dir() -> Path:
    return Path(os.environ.get("EMBER_KERNEL_CACHE", Path.home() / ".cache" / "ember_cupy" / "kernels"))


def _source_digest(source: str, arch: str, options: tuple[str, ...], version) -> str:
    digest = hashlib.sha256()
    for path in [CUDA_SOURCE_DIR / source, *sorted(CUDA_SOURCE_DIR.glob("*.cuh"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"{arch}|{' '.join(options)}|{version}".encode())
    return digest.hexdigest()[:24]


def nvrtc_compile(source: str, arch: str, options: tuple[str, ...] = NVRTC_OPTIONS,
                  target: str = "cubin") -> tuple[bytes, str]:
    """Compile cuda/`source` for sm_`arch` with NVRTC; returns (CUBIN or PTX, program log)."""
    from cupy_backends.cuda.libs import nvrtc
    text = (CUDA_SOURCE_DIR / source).read_text()
    program = nvrtc.createProgram(text, source, [], [])
    flags = [f"-arch=sm_{arch}" if target == "cubin" else f"-arch=compute_{arch}",
             f"-I{CUDA_SOURCE_DIR}", f"-I{cuda_include_dir()}", *options]
    try:
        nvrtc.compileProgram(program, flags)
    except nvrtc.NVRTCError as error:
        raise KernelCompileError(f"NVRTC failed on {source} (sm_{arch}):\n"
                                 f"{nvrtc.getProgramLog(program)}") from error
    try:
        log = nvrtc.getProgramLog(program)
        binary = nvrtc.getCUBIN(program) if target == "cubin" else nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)
    return (binary if isinstance(binary, bytes) else binary.encode()), log


def compile_cubin(source: str, arch: str, options: tuple[str, ...] = NVRTC_OPTIONS) -> Path:
    """Path of the cached CUBIN of cuda/`source` for sm_`arch`, compiling it on a miss."""
    from cupy_backends.cuda.libs import nvrtc
    key = _source_digest(source, arch, options, nvrtc.getVersion())
    path = _cache_dir() / f"{Path(source).stem}-sm{arch}-{key}.cubin"
    if not path.exists():
        binary, _ = nvrtc_compile(source, arch, options)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(binary)
        os.replace(tmp, path)
    return path
