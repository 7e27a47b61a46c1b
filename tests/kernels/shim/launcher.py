"""Runs cuda/*.cu kernels on the CPU: g++ compiles the unchanged .cu text with shim.h force-included,
and ctypes calls it with cupy.RawKernel's call shape, `fn(grid, block, args, shared_mem=)`, on NumPy
arrays. Arguments are checked against the kernel's real C signature (dtype of every pointer, exact
width of every scalar: CuPy would pass a Python int as 64-bit, so scalars must be NumPy scalars).

Environment: EMBER_SHIM_MODE = fibers | fibers-reverse | threads (default fibers);
EMBER_SHIM_SANITIZE = address | thread (builds with that sanitizer; its runtime must be preloaded);
EMBER_SHIM_CACHE = build cache directory (default ~/.cache/ember_cupy/shim).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ember_cupy.ops import _cuda

SHIM_DIR = Path(__file__).resolve().parent
MODES = {"fibers": 0, "fibers-reverse": 1, "threads": 2}
SANITIZER_FLAGS = {"": ["-O2"], "address": ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"],
                   "thread": ["-O1", "-g", "-fsanitize=thread"]}
MAX_THREADS_PER_BLOCK = 1024
MAX_DYNAMIC_SHARED = 48 * 1024   # without cudaFuncSetAttribute opt-in, as on the GPU
DTYPE_CODES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int8": "i8",
               "uint8": "u8", "int16": "i16", "uint16": "u16", "int32": "i32", "uint32": "u32",
               "int64": "i64", "uint64": "u64"}


class ShimError(RuntimeError):
    """A kernel broke a rule the shim checks (divergent barrier, exited lane, deadlock)."""


class _LaunchSpec(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_ulonglong), ("mode", ctypes.c_int)]


def _compile_flags(sanitize: str) -> list[str]:
    return ["-std=c++20", "-fPIC", "-shared", "-Wall", "-Werror", "-Wno-unknown-pragmas",
            *SANITIZER_FLAGS[sanitize], "-include", str(SHIM_DIR / "shim.h"), f"-I{SHIM_DIR}",
            f"-I{_cuda.CUDA_SOURCE_DIR}", f"-I{_cuda.cuda_include_dir()}"]


def _scan(source: Path, flags: list[str]) -> tuple[str, list[str]]:
    """Preprocess once: the text keys the build cache, and its markers name the kernels."""
    text = subprocess.run(["g++", "-E", "-P", "-DEMBER_SHIM_SCAN", *flags, "-x", "c++", str(source)],
                          check=True, capture_output=True, text=True).stdout
    names = re.findall(r"__shim_kernel__\s+void\s+(\w+)\s*\(", text)
    return text, sorted(set(names))


def build(source: Path, sanitize: str = "") -> tuple[Path, list[str]]:
    """Compile `source` into a shared library (cached by preprocessed text + flags)."""
    flags = _compile_flags(sanitize)
    text, names = _scan(source, flags)
    key = hashlib.sha256((text + "\0" + " ".join(flags)).encode()).hexdigest()[:20]
    cache = Path(os.environ.get("EMBER_SHIM_CACHE", Path.home() / ".cache" / "ember_cupy" / "shim"))
    library = cache / f"{source.stem}-{sanitize or 'plain'}-{key}.so"
    if not library.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            wrapper = Path(tmp) / f"{source.stem}.shim.cpp"
            wrapper.write_text(f'#include "{source}"\n' + "".join(f"SHIM_EXPORT({n})\n" for n in names))
            out = Path(tmp) / library.name
            result = subprocess.run(["g++", *flags, str(wrapper), "-o", str(out)], check=False,
                                    capture_output=True, text=True)
            if result.returncode:
                raise ShimError(f"g++ failed on {source.name}:\n{result.stderr[-4000:]}")
            os.replace(out, library)
    return library, names


def _dims(value) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(int(d) < 1 for d in dims):
        raise ValueError(f"grid/block dimensions must be 1-3 positive ints, got {value!r}")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


class ShimKernel:
    def __init__(self, library: ctypes.CDLL, name: str):
        self.name = name
        self._launch = getattr(library, f"shim_launch_{name}")
        self._launch.restype = ctypes.c_int
        signature = getattr(library, f"shim_signature_{name}")
        signature.restype = ctypes.c_char_p
        self.signature = signature().decode().split(",") if signature() else []

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        grid, block = _dims(grid), _dims(block)
        if np.prod(block) > MAX_THREADS_PER_BLOCK:
            raise ValueError(f"{self.name}: {np.prod(block)} threads per block > {MAX_THREADS_PER_BLOCK}")
        if not 0 <= int(shared_mem) <= MAX_DYNAMIC_SHARED:
            raise ValueError(f"{self.name}: dynamic shared memory {shared_mem} B > {MAX_DYNAMIC_SHARED} B")
        holders = self._marshal(tuple(args))
        pointers = (ctypes.c_void_p * max(1, len(holders)))(*[h.ctypes.data for h in holders])
        spec = _LaunchSpec((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), int(shared_mem),
                           MODES[os.environ.get("EMBER_SHIM_MODE", "fibers")])
        error = ctypes.create_string_buffer(1024)
        if self._launch(ctypes.byref(spec), pointers, error, ctypes.c_size_t(len(error))):
            raise ShimError(f"{self.name}: {error.value.decode()}")

    def _marshal(self, args: tuple) -> list[np.ndarray]:
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name} takes {len(self.signature)} arguments "
                            f"({','.join(self.signature)}), got {len(args)}")
        return [self._marshal_one(i, code, arg) for i, (code, arg) in enumerate(zip(self.signature, args))]

    def _marshal_one(self, index: int, code: str, arg) -> np.ndarray:
        where = f"{self.name} argument {index}"
        if code.startswith("*"):
            if not isinstance(arg, np.ndarray):
                raise TypeError(f"{where}: expected an array of {code[1:]}, got {type(arg).__name__}")
            if DTYPE_CODES.get(arg.dtype.name) != code[1:]:
                raise TypeError(f"{where}: expected {code[1:]} data, got {arg.dtype}")
            return np.array(arg.ctypes.data, dtype=np.uintp)
        if not isinstance(arg, np.generic):
            raise TypeError(f"{where}: pass a NumPy scalar of type {code}, not a Python "
                            f"{type(arg).__name__} (CuPy would pass it as a 64-bit value)")
        if DTYPE_CODES.get(arg.dtype.name) != code:
            raise TypeError(f"{where}: expected a {code} scalar, got {arg.dtype}")
        return np.array(arg)


class ShimModule:
    """The CPU counterpart of cupy.RawModule for one .cu file."""

    def __init__(self, source: str | Path, sanitize: str | None = None):
        sanitize = os.environ.get("EMBER_SHIM_SANITIZE", "") if sanitize is None else sanitize
        path = Path(source)
        path = path if path.is_absolute() else _cuda.CUDA_SOURCE_DIR / path
        library_path, self.names = build(path, sanitize)
        self._library = ctypes.CDLL(str(library_path))
        self._kernels: dict[str, ShimKernel] = {}

    def get_function(self, name: str) -> ShimKernel:
        if name not in self.names:
            raise AttributeError(f"no kernel {name!r} (kernels: {', '.join(self.names)})")
        if name not in self._kernels:
            self._kernels[name] = ShimKernel(self._library, name)
        return self._kernels[name]


class ShimProvider:
    """Plugs into ember_cupy.ops._cuda.use_provider(): every op then runs its kernel on the CPU."""

    def __init__(self, sanitize: str | None = None):
        self.sanitize = sanitize
        self._modules: dict[str, ShimModule] = {}

    def function(self, source: str, name: str) -> ShimKernel:
        if source not in self._modules:
            self._modules[source] = ShimModule(source, self.sanitize)
        return self._modules[source].get_function(name)
