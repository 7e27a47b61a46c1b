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

from ember_cupy.backend import nvidia_wheel_dirs, preload_nvrtc_builtins
from ember_cupy.ops._sources import kernel_source_dir

CUDA_SOURCE_DIR = kernel_source_dir("cuda", "EMBER_CUDA_SOURCES")
NVRTC_OPTIONS = ("-std=c++17",)

_provider = None
_modules: dict[tuple[str, str], object] = {}          # (source, arch) -> RawModule
_functions: dict[tuple[str, str, str], object] = {}   # (source, kernel, arch) -> RawKernel
_archs: dict[int, str] = {}                           # device id -> compute capability


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
    """The kernel `name` of cuda/`source`, callable as fn(grid, block, args, shared_mem=); looked
    up once per (source, name, device architecture), not at every launch."""
    if _provider is not None:
        return _provider.function(source, name)
    key = (source, name, _device_arch())
    kernel = _functions.get(key)
    if kernel is None:
        kernel = _functions[key] = load_module(source).get_function(name)
    return kernel


def load_module(source: str):
    """cuda/`source` compiled for the current device (CUBIN disk cache) and loaded, once."""
    import cupy
    arch = _device_arch()
    key = (source, arch)
    if key not in _modules:
        _modules[key] = cupy.RawModule(path=str(compile_cubin(source, arch)))
    return _modules[key]


def _device_arch() -> str:
    """Compute capability of the current device, e.g. "90" (one query per device id)."""
    import cupy
    device_id = cupy.cuda.runtime.getDevice() if hasattr(cupy.cuda.runtime, "getDevice") else 0
    arch = _archs.get(device_id)
    if arch is None:
        arch = _archs[device_id] = cupy.cuda.Device(device_id).compute_capability
    return arch


def clear_caches() -> None:
    """Forget loaded modules and looked-up kernels (tests that swap the cupy module)."""
    _modules.clear()
    _functions.clear()
    _archs.clear()


# --- NVRTC ----------------------------------------------------------------------------------
# Which pip wheels hold the headers: cuda_fp16.h / cuda_bf16.h are in the CUDA runtime wheel
# (nvidia-cuda-runtime-cu12: nvidia/cuda_runtime/include; CUDA 13's nvidia-cuda-runtime:
# nvidia/cu13/include), never in the NVRTC wheel (only nvrtc.h). setup.cfg's cuda12/cuda13 extras
# declare them.
def cuda_include_dir() -> Path:
    """A directory holding cuda_fp16.h and cuda_bf16.h; NVRTC does not find them by itself with
    pip-installed CUDA. Order: EMBER_CUDA_INCLUDE, CUDA_PATH/CUDA_HOME, nvcc's toolkit,
    /usr/local/cuda, the pip wheels under nvidia/."""
    candidates = [os.environ.get("EMBER_CUDA_INCLUDE")]
    candidates += [os.path.join(os.environ[v], "include") for v in ("CUDA_PATH", "CUDA_HOME") if v in os.environ]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include"))
    candidates.append("/usr/local/cuda/include")
    candidates += [str(p) for p in nvidia_wheel_dirs("include")]
    for candidate in filter(None, candidates):
        if all(os.path.isfile(os.path.join(candidate, h)) for h in ("cuda_fp16.h", "cuda_bf16.h")):
            return Path(candidate)
    raise FileNotFoundError(
        "cuda_fp16.h / cuda_bf16.h not found (NVRTC needs them for the kernels): install the CUDA runtime "
        "headers wheel (pip install 'ember-cupy[cuda12]' or '[cuda13]', which include nvidia-cuda-runtime), "
        "or set EMBER_CUDA_INCLUDE to a CUDA include directory")


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
    preload_nvrtc_builtins()   # before NVRTC looks for it (no $ORIGIN runpath)
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
