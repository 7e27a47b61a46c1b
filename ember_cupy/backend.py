"""Array backend selection: CuPy when a CUDA device is usable, else NumPy (CuPy is not even
imported where no NVIDIA driver is visible).

`EMBER_BACKEND=numpy|cupy` overrides the automatic choice. Everything above `ops/` calls
`get_xp()` and stays backend-agnostic.
"""
from __future__ import annotations

import functools
import os
import types
from pathlib import Path

import numpy as np

BACKENDS = ("numpy", "cupy")


class BackendError(RuntimeError):
    """The requested backend cannot be used on this machine."""


# Where an NVIDIA driver lives: its device nodes (Linux, containers run with --gpus) or WSL's GPU.
_DRIVER_PATHS = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/dxg")


def nvidia_driver_visible() -> bool:
    return any(os.path.exists(path) for path in _DRIVER_PATHS)


def _cupy_or_reason() -> tuple[types.ModuleType | None, str]:
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        return None, f"cupy is not importable ({exc})"
    preload_nvrtc_builtins()   # CuPy's own first kernel below compiles through NVRTC
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "no CUDA device is visible"
        cupy.zeros(1).sum()  # a real allocation + kernel: catches driver mismatches
    except Exception as exc:
        return None, f"no usable CUDA device ({exc})"
    return cupy, ""


def nvidia_wheel_dirs(leaf: str) -> list[Path]:
    """<site-packages>/nvidia/*/<leaf> of the installed NVIDIA pip wheels (cu12 and cu13 layouts)."""
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(p for root in nvidia.__path__ for p in Path(root).glob(f"*/{leaf}") if p.is_dir())


_builtins_loaded = False


def preload_nvrtc_builtins() -> list[str]:
    """Load every libnvrtc-builtins of the NVIDIA wheels, once, before NVRTC needs one.

    The wheels' libnvrtc has no $ORIGIN runpath, so its own dlopen of libnvrtc-builtins.so.13.0
    fails unless that folder is on LD_LIBRARY_PATH (read only at process start). A library already
    loaded under the same soname satisfies that dlopen. Returns the paths loaded (first call)."""
    global _builtins_loaded
    if _builtins_loaded:
        return []
    _builtins_loaded = True
    import ctypes
    loaded = []
    for folder in nvidia_wheel_dirs("lib"):
        for library in sorted(folder.glob("libnvrtc-builtins.so.*")):
            try:
                ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
                loaded.append(str(library))
            except OSError:
                continue
    return loaded


@functools.lru_cache(maxsize=None)
def get_backend_name() -> str:
    requested = os.environ.get("EMBER_BACKEND", "").strip().lower()
    if requested and requested not in BACKENDS:
        raise BackendError(f"EMBER_BACKEND={requested!r} is not one of {BACKENDS}")
    if requested == "numpy":
        return "numpy"
    if not requested and not nvidia_driver_visible():
        return "numpy"     # importing CuPy alone costs ~0.6 s and ~30 MB on a machine without a GPU
    cupy, reason = _cupy_or_reason()
    if requested == "cupy" and cupy is None:
        raise BackendError(f"EMBER_BACKEND=cupy was requested but {reason}")
    return "cupy" if cupy is not None else "numpy"


def get_xp() -> types.ModuleType:
    """The array module of the selected backend (numpy or cupy)."""
    if get_backend_name() == "cupy":
        import cupy
        return cupy
    return np


def to_numpy(array) -> np.ndarray:
    """A host copy of an array of either backend."""
    if isinstance(array, np.ndarray):
        return array
    return array.get()


def lazily_zeroed(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zero-filled host array in its own anonymous mapping: pages become resident only when
    written. np.zeros does not promise that: from a thread's malloc arena, or once glibc's mmap
    threshold has grown past the size, calloc zero-fills the whole block at once (a KV pool
    allocated that way was resident in full at start-up: 568 MiB for the default model)."""
    import mmap

    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    mapping = mmap.mmap(-1, max(1, count * dtype.itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mapping, dtype=dtype, count=count).reshape(shape)


def _linux_libc():
    """The C library (ctypes), or None off Linux or where it cannot be loaded."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed_heap() -> None:
    """Give the free pages of the C heap back to the OS (glibc's malloc_trim; Linux only).

    keep_freed_memory_mapped stops glibc from trimming by itself, so what a model's load built
    and dropped stays resident: building Gemma 3's 262k-piece tokenizer leaves 44 MB of it
    (a 49k vocabulary ~7 MB). The engine calls this once its model is loaded; the steps'
    temporaries come after and stay mapped."""
    libc = _linux_libc()
    if libc is not None and hasattr(libc, "malloc_trim"):   # glibc
        libc.malloc_trim(0)


def keep_freed_memory_mapped() -> bool:
    """Stop glibc from returning large freed blocks to the OS (Linux only).

    A forward pass allocates the same MB-sized temporaries every step; by default each one is
    a fresh mmap that page-faults on first touch, which made CPU attention ~4x slower. Returns
    whether the allocator accepted the settings.

    This is the process's policy, not the engine's: mallopt applies to every allocation of the
    process (an application that embeds the engine keeps its freed memory mapped too). The first
    host-side LLMEngine sets it; EMBER_KEEP_FREED_MEMORY=0 leaves glibc's defaults.
    """
    libc = _linux_libc()
    if libc is None or not hasattr(libc, "mallopt") or os.environ.get("EMBER_KEEP_FREED_MEMORY") == "0":
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 2**31 - 1))
