"""A stand-in `cupy` for machines without a GPU, so that the code's real `xp=cupy` branches run in CI.

Its arrays hold NumPy buffers but are NOT np.ndarray instances (so `isinstance(x, np.ndarray)`
dispatch takes the device branch), and they refuse what CuPy refuses: implicit conversion to NumPy
(`np.asarray(device_array)` raises TypeError), host arrays mixed into device arithmetic or passed to
a kernel, reductions over zero-size arrays without identity (argmax of a (0, vocab) array).
`empty` hands out poisoned memory (NaN / 0xA5 bytes), as uninitialised device memory would be.
`RawModule(path=<cubin>)` checks it got a CUBIN (an ELF from NVRTC, compiled for real by
ember_cupy.ops._cuda) and launches the same .cu source through the CPU shim (launcher.py).

`installed()` puts it in sys.modules as `cupy` (with `cupy.cuda`, `cupy._core`, ...) for a with-block.
"""
from __future__ import annotations

import contextlib
import sys
import time
import types
from pathlib import Path

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

__version__ = "14.2.0-standin"
_POISON_BYTE = 0xA5


def _refuse_host(value, where: str):
    if isinstance(value, np.ndarray) and value.ndim > 0:
        raise TypeError(f"Unsupported type {type(value)} in {where}: a host array mixed with device arrays")
    return value


def _unwrap(value, where: str = "an operation", allow_host: bool = False):
    if isinstance(value, ndarray):
        return value._a
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v, where, allow_host) for v in value)
    return value if allow_host else _refuse_host(value, where)


def _wrap(value):
    if isinstance(value, np.ndarray):
        return ndarray(value)
    if isinstance(value, tuple):
        return tuple(_wrap(v) for v in value)
    return value


class _Pointer:
    def __init__(self, ptr: int):
        self.ptr = ptr


class ndarray(NDArrayOperatorsMixin):  # noqa: N801 -- cupy's spelling
    """A device array: a NumPy buffer behind CuPy's interface."""

    __slots__ = ("_a",)

    def __init__(self, array: np.ndarray):
        self._a = array

    # --- what CuPy refuses ----------------------------------------------------------------
    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        name = f"{ufunc.__name__}.{method}" if method != "__call__" else ufunc.__name__
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(_unwrap(o, name) for o in out)
        operands = [_unwrap(x, name) for x in inputs]
        result = getattr(ufunc, method)(*operands, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        if ufunc is np.matmul and out is None:   # ml_dtypes' bfloat16 matmul answers float32; CuPy's keeps bf16
            result = result.astype(np.result_type(*operands), copy=False)
        return _wrap(result)

    # --- attributes -----------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    strides = property(lambda self: self._a.strides)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray(self._a.T))
    data = property(lambda self: _Pointer(self._a.ctypes.data))

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"standin_cupy.ndarray({self._a!r})"

    def __bool__(self):
        return bool(self._a)

    def __int__(self):
        return int(self._a)

    def __float__(self):
        return float(self._a)

    def __index__(self):
        return self._a.__index__()

    def __iter__(self):
        return (_wrap(x) if isinstance(x, np.ndarray) else ndarray(np.asarray(x)) for x in self._a)

    def __getitem__(self, key):
        return _wrap(self._a[_unwrap(key, "indexing", allow_host=True)])

    def __setitem__(self, key, value):
        self._a[_unwrap(key, "indexing", allow_host=True)] = _unwrap(value, "assignment", allow_host=True)

    # --- methods --------------------------------------------------------------------------
    def get(self, stream=None, order="C", out=None):
        return np.array(self._a, order=order)

    def item(self):
        return self._a.item()

    def tolist(self):
        return self._a.tolist()

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        return ndarray(self._a.astype(dtype, order=order, copy=copy))

    def copy(self, order="C"):
        return ndarray(self._a.copy(order=order))

    def view(self, dtype=None):
        return ndarray(self._a.view() if dtype is None else self._a.view(dtype))

    def fill(self, value):
        self._a.fill(value)

    def set(self, array, stream=None):
        """Host -> device copy into this array (shapes must match, as in CuPy)."""
        if array.shape != self._a.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self._a.shape}, new shape: {array.shape}")
        self._a[...] = array

    def _reduce(self, name, *args, **kwargs):
        if self._a.size == 0 and name in ("argmax", "argmin", "max", "min"):
            raise ValueError(f"zero-size array to reduction operation cupy_{name} which has no identity")
        return _wrap(np.asarray(getattr(self._a, name)(*_unwrap(args), **kwargs)))


def _forward(name):
    def method(self, *args, **kwargs):
        return _wrap(getattr(self._a, name)(*_unwrap(args, name), **kwargs))
    method.__name__ = name
    return method


def _reduction(name):
    def method(self, *args, **kwargs):
        return self._reduce(name, *args, **kwargs)
    method.__name__ = name
    return method


for _name in ("reshape", "ravel", "transpose", "swapaxes", "squeeze", "flatten", "nonzero", "clip",
              "cumsum", "dot", "repeat", "take"):
    setattr(ndarray, _name, _forward(_name))
for _name in ("argmax", "argmin", "max", "min", "sum", "mean", "prod", "all", "any", "var", "std"):
    setattr(ndarray, _name, _reduction(_name))


# --- creation -------------------------------------------------------------------------------
def asarray(a, dtype=None, order=None, blocking=False):
    """Host data is copied to the 'device' (a device array never aliases host memory)."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    return ndarray(np.array(a, dtype=dtype, order=order or "K", copy=True))


def array(obj, dtype=None, copy=True, order="K", ndmin=0, blocking=False):
    if isinstance(obj, ndarray):
        return ndarray(np.array(obj._a, dtype=dtype, copy=copy, order=order, ndmin=ndmin))
    return ndarray(np.array(obj, dtype=dtype, copy=True, order=order, ndmin=ndmin))


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(f"Argument 'a' has incorrect type (expected cupy.ndarray, got {type(a).__name__})")
    return ndarray(np.ascontiguousarray(a._a, dtype=dtype))


def empty(shape, dtype=float, order="C"):
    """Uninitialised memory is poisoned: NaN in floats, 0xA5 bytes elsewhere."""
    out = np.empty(shape, dtype=dtype, order=order)
    out.view(np.uint8).reshape(-1)[:] = _POISON_BYTE
    if out.dtype.kind == "f" or out.dtype.name == "bfloat16":
        out[...] = np.nan
    return ndarray(out)


def empty_like(a, dtype=None, order="K", shape=None):
    return empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def _generic(name):
    function = getattr(np, name)

    def call(*args, **kwargs):
        kwargs = {k: _unwrap(v, name) for k, v in kwargs.items()}
        return _wrap(function(*_unwrap(args, name), **kwargs))
    call.__name__ = name
    return call


_GENERIC = ("zeros", "ones", "full", "arange", "zeros_like", "ones_like", "full_like", "concatenate",
            "stack", "where", "exp", "log", "tanh", "sqrt", "maximum", "minimum", "isnan", "isfinite",
            "cumsum", "repeat", "matmul", "searchsorted", "sort", "argsort", "take_along_axis", "unique")
for _name in _GENERIC:
    globals()[_name] = _generic(_name)
for _name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint32",
              "uint64", "bool_", "dtype", "inf", "nan", "newaxis"):
    globals()[_name] = getattr(np, _name)


# --- kernels: NVRTC's CUBIN in, the CPU shim runs the source ---------------------------------
class RawKernel:
    def __init__(self, shim_kernel, name: str):
        self._kernel, self.name = shim_kernel, name

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None):
        host_args = []
        for index, arg in enumerate(args):
            if isinstance(arg, np.ndarray):
                raise TypeError(f"{self.name} argument {index}: Unsupported type {type(arg)} "
                                "(a host array passed to a device kernel)")
            host_args.append(arg._a if isinstance(arg, ndarray) else arg)
        self._kernel(grid, block, tuple(host_args), shared_mem=shared_mem)


class RawModule:
    """Loads a CUBIN; its kernels run the .cu file it was compiled from (named by ops/_cuda's
    cache file name `<stem>-sm<arch>-<key>.cubin`) through the CPU shim."""

    loaded: list[Path] = []

    def __init__(self, code=None, path=None, options=(), backend="nvrtc", **kwargs):
        if path is None:
            raise NotImplementedError("the stand-in loads compiled CUBINs only (path=...)")
        path = Path(path)
        if path.read_bytes()[:4] != b"\x7fELF":
            raise RuntimeError(f"{path} is not a CUBIN (no ELF header)")
        from .launcher import ShimModule
        self._module = ShimModule(path.name.split("-sm")[0] + ".cu")
        RawModule.loaded.append(path)

    def get_function(self, name: str) -> RawKernel:
        return RawKernel(self._module.get_function(name), name)


# --- cupy.cuda, cupy._core ----------------------------------------------------------------
class Device:
    compute_capability = "90"

    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._time = None

    def record(self, stream=None):
        self._time = time.perf_counter()

    def synchronize(self):
        pass


def get_elapsed_time(start: Event, end: Event) -> float:
    return (end._time - start._time) * 1e3


def _runtime_module() -> types.ModuleType:
    runtime = types.ModuleType("cupy.cuda.runtime")
    runtime.getDeviceCount = lambda: 1
    runtime.getDevice = lambda: 0
    runtime.memGetInfo = lambda: (6 << 30, 8 << 30)
    runtime.runtimeGetVersion = lambda: 13000
    runtime.driverGetVersion = lambda: 13000
    runtime.getDeviceProperties = lambda device: {
        "name": b"stand-in (NumPy + CPU shim)", "totalGlobalMem": 8 << 30, "multiProcessorCount": 1,
        "memoryClockRate": 0, "memoryBusWidth": 0, "major": 9, "minor": 0}
    return runtime


compute_types: dict = {}   # what set_compute_type was asked for, by dtype


def _modules() -> dict[str, types.ModuleType]:
    this = sys.modules[__name__]
    cuda = types.ModuleType("cupy.cuda")
    cuda.Device, cuda.Event, cuda.get_elapsed_time = Device, Event, get_elapsed_time
    cuda.runtime = _runtime_module()
    cuda.alloc_pinned_memory = lambda nbytes: bytearray(nbytes)   # a writable buffer, as PinnedMemoryPointer
    cuda.is_available = lambda: True
    core = types.ModuleType("cupy._core")
    core.set_compute_type = lambda dtype, compute_type: compute_types.__setitem__(np.dtype(dtype).name,
                                                                                  compute_type)
    linalg = types.ModuleType("cupy._core._routines_linalg")
    linalg.COMPUTE_TYPE_DEFAULT, linalg.COMPUTE_TYPE_PEDANTIC, linalg.COMPUTE_TYPE_FP32 = 0, 1, 4
    core._routines_linalg = linalg
    this.cuda, this._core = cuda, core
    return {"cupy": this, "cupy.cuda": cuda, "cupy.cuda.runtime": cuda.runtime, "cupy._core": core,
            "cupy._core._routines_linalg": linalg}


def _load_real_nvrtc() -> None:
    """NVRTC is real: CuPy's binding finds its library through the real cupy package
    (cupy._environment), so it is loaded once before the stand-in takes that name."""
    from cupy_backends.cuda.libs import nvrtc
    nvrtc.getVersion()


@contextlib.contextmanager
def installed():
    """`import cupy` gives the stand-in, EMBER_BACKEND=cupy, inside the block; ember_cupy's caches
    of the backend choice and of loaded kernel modules are cleared on the way in and out."""
    import os

    from ember_cupy import backend
    from ember_cupy.ops import _cuda
    _load_real_nvrtc()
    names = _modules()
    saved = {name: sys.modules.get(name) for name in names}
    saved_env = os.environ.get("EMBER_BACKEND")
    sys.modules.update(names)
    os.environ["EMBER_BACKEND"] = "cupy"
    backend.get_backend_name.cache_clear()
    _cuda.clear_caches()
    try:
        yield sys.modules[__name__]
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        if saved_env is None:
            os.environ.pop("EMBER_BACKEND", None)
        else:
            os.environ["EMBER_BACKEND"] = saved_env
        backend.get_backend_name.cache_clear()
        _cuda.clear_caches()
