"""Linear layers: y = x @ W for a float weight stored [in, out], or for a quantized one [out, in]
kept in its GGUF blocks.

`matmul_q` dispatches on the weight's form, one signature for all:
- `PackedWeight` / `StackedWeight` (host): the host kernel (cpu/matmul_q.c: x quantized to int8
  blocks once per call, integer dot products against each part in its own format) or its NumPy
  twin `matmul_q_numpy` (fake-quantized x @ dequantized W, the same arithmetic in real numbers);
- `HalfWeight` (host, a 16-bit float matrix, or a part of a `StackedWeight`): cpu/matmul_16bit.c,
  x as it is (not quantized) times W widened in registers, or its twin `matmul_16bit_numpy`;
- `DequantizedWeight` (host, no kernels here): the twin, on W dequantized once at load;
- `DeviceQuantizedWeight` (CUDA): weight-only, x stays in its float dtype; cuda/matmul_q.cu or its
  NumPy twin `matmul_q_cuda_numpy` (x @ dequantized W^T in fp32); a `DeviceStack` of them (parts
  in different formats) part by part.
For up to GEMV_MAX_ROWS rows the GEMV kernel reads W once per 4 rows of x; above, W is
dequantized into a scratch slice by slice and multiplied by cuBLAS on tensor cores. Why 8 (an
H200 estimate, no measurement): the GEMV spends ~3 issue slots per weight per 4-row read on
unpacking and ~2 per weight per row on CUDA cores (33.5 T lane-instructions/s), ~0.9 ps per weight
at M = 8; the scratch moves ~4.6 bytes per weight at 4.8 TB/s (Q4_1 0.6 read, 16-bit W written and
read back), ~0.96 ps per weight whatever M. A tiled tensor-core kernel would beat both from M ~ 8.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ember_cupy.ops import _cuda, _host
from ember_cupy.half_weight import HalfWeight, matmul_16bit_numpy
from ember_cupy.ops._kernel import array_module, i32, kernel
from ember_cupy.packed_weight import DequantizedWeight, PackedWeight, StackedWeight
from ember_cupy.quant import (ONE_PASS, ActivationQuantization, DeviceQuantizedWeight, DeviceStack, QuantizedTensor,
                              fake_quantize_activations)

GEMV_MAX_ROWS = 8
GEMV_ROWS_PER_BLOCK = 8          # weight rows per block of the GEMV (cuda/matmul_q.cu kRowsPerBlock)
THREADS = 128                    # both kernels: 4 warps
SCRATCH_BYTES = 64 << 20         # dequantized slice of W in the large-M path
_FORMAT_NAMES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_k", "Q6_K": "q6_k"}


class WeightPart(ctypes.Structure):
    """cpu/matmul_q.h EmberWeightPart: rows of a matrix in one packed format."""
    _fields_ = [("w", ctypes.c_void_p), ("rows", ctypes.c_int64), ("wtype", ctypes.c_int32)]


def weight_parts(weight: PackedWeight | StackedWeight | HalfWeight) -> ctypes.Array:
    """The kernel's view of a host weight (it points into the weight's arrays: keep both alive)."""
    return (WeightPart * len(weight.parts))(*(WeightPart(p.data.ctypes.data, p.shape[0], p.kernel_type)
                                               for p in weight.parts))




HOST_WEIGHTS = (PackedWeight, StackedWeight, HalfWeight, DequantizedWeight)   # what matmul_q takes on the host


def linear(x, weight, activations: ActivationQuantization = ONE_PASS, deterministic: bool = False,
           prompt_rows=None):
    """x [T, in] -> [T, out]; `activations`: how x is quantized for a host-quantized weight;
    `deterministic`: a device-quantized weight's rows computed alike whatever T (matmul_q_cuda);
    `prompt_rows` ([T] bools, or None): the rows a host-packed weight multiplies in bf16
    (matmul_q_bf16), the others as `activations` says: a row's role picks its kernel, not T."""
    if prompt_rows is not None and isinstance(weight, (PackedWeight, StackedWeight, HalfWeight)):
        return _matmul_by_role(x, weight, activations, np.asarray(prompt_rows, dtype=bool))
    if isinstance(weight, HOST_WEIGHTS + (DeviceQuantizedWeight, DeviceStack)):
        return matmul_q(x, weight, activations=activations, deterministic=deterministic)
    return float_matmul(x, weight)


def _matmul_by_role(x, weight, activations: ActivationQuantization, prompt_rows: np.ndarray) -> np.ndarray:
    """Each run of prompt rows through matmul_q_bf16, each run of the others through matmul_q (as
    cpu/layer.c splits a step's rows)."""
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
    edges = np.flatnonzero(np.diff(prompt_rows.astype(np.int8))) + 1
    for start, stop in zip([0, *edges], [*edges, len(prompt_rows)]):
        rows = x[start:stop]
        out[start:stop] = matmul_q_bf16(rows, weight) if prompt_rows[start] else matmul_q(rows, weight, activations=activations)
    return out


# Inner-dimension slice of a float GEMM on NumPy (float_matmul): within one of OpenBLAS's K blocks
# (384 on Haswell; 256 leaves a margin) its kernels for small and large matrices sum alike.
FLOAT_MATMUL_K_SLICE = 256


def float_matmul(x, w):
    """x @ w, each row's bits independent of the other rows' on NumPy, for w a C-contiguous
    [in, out] of a model's shape. OpenBLAS sums a row of a GEMM in another order depending on M:
    a lone row goes through its GEMV (so it is computed as two), and a small product (M*N*K up to
    about 1M) through a kernel that sums all of K in one pass where the blocked one sums blocks
    of K (576 x 576 at M = 2-3 differed). So K is summed FLOAT_MATMUL_K_SLICE at a time, left to
    right. (A transposed w, or a few output columns, take yet other kernels: checked not to hold,
    so the models' matrices are kept [in, out]; tests/test_float_matmul.py.)"""
    if not (isinstance(x, np.ndarray) and x.ndim == 2):
        return x @ w
    if x.shape[0] == 1:
        return float_matmul(np.concatenate([x, x]), w)[:1]
    k = FLOAT_MATMUL_K_SLICE
    out = x[:, :k] @ w[:k]
    for start in range(k, x.shape[1], k):
        out += x[:, start:start + k] @ w[start:start + k]
    return out


def embedding(table, ids, dtype=np.float32):
    """Rows `ids` of an embedding table (float, or quantized and dequantized row by row; a device
    table is dequantized on the device, into `dtype`)."""
    if isinstance(table, DeviceQuantizedWeight):
        if _cuda.wants_kernel(ids):
            return _dequantize_rows_kernel(table, ids, dtype)
        return dequantize_rows_numpy(table, ids, dtype)
    if isinstance(table, (QuantizedTensor, PackedWeight, HalfWeight, DequantizedWeight)):
        return table.dequantize(np.asarray(ids))
    return table[ids]


def matmul_q(x, weight, library=None, activations: ActivationQuantization = ONE_PASS, out_dtype=None,
             deterministic: bool = False):
    """x [M, K] @ weight[N, K]^T -> [M, N].
    PackedWeight: x float32, out float32; host kernel when one is active; x quantized to int8
    blocks as `activations` says (two passes: ~14-bit activations where they matter; a row's
    result never depends on M, so `deterministic` changes nothing here). HalfWeight (or a
    StackedWeight's 16-bit part): x as it is, whatever `activations` says.
    DeviceQuantizedWeight: out in x's dtype, or `out_dtype` (float32 for the LM head's logits);
    `deterministic`: the GEMV for every M (matmul_q_cuda). DeviceStack: its parts' outputs side by side.
    """
    if isinstance(weight, DeviceStack):
        return array_module(x).concatenate([matmul_q(x, part, out_dtype=out_dtype, deterministic=deterministic)
                                            for part in weight.parts], axis=1)
    if isinstance(weight, DeviceQuantizedWeight):
        if _cuda.wants_kernel(x):
            return matmul_q_cuda(x, weight, out_dtype, deterministic)
        return matmul_q_cuda_numpy(x, weight, out_dtype)
    if out_dtype is not None and np.dtype(out_dtype) != np.float32:
        raise ValueError(f"the host matmul_q computes float32, not {np.dtype(out_dtype)}")
    library = library or _host.active()
    if library is None or isinstance(weight, DequantizedWeight):
        return matmul_q_numpy(x, weight, activations)
    _check(x, weight)
    if x.dtype != np.float32 or x.strides[-1] != 4:
        x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = weight.shape
    out = np.empty((x.shape[0], rows), dtype=np.float32)
    parts = weight_parts(weight)
    status = library.lib.ember_matmul_parts(
        x.ctypes.data, x.shape[0], cols, x.strides[0] // 4, ctypes.addressof(parts), len(parts), out.ctypes.data,
        rows, activations.passes, activations.second_pass_threshold)
    if status:
        raise RuntimeError(f"ember_matmul_parts failed with status {status}")
    return out


def matmul_q_numpy(x: np.ndarray, weight: PackedWeight | StackedWeight | HalfWeight | DequantizedWeight,
                   activations: ActivationQuantization = ONE_PASS) -> np.ndarray:
    """The NumPy twin of the host kernel: the int8 activation blocks, and W as its blocks say
    (a 16-bit part: matmul_16bit_numpy, x as it is)."""
    _check(x, weight)
    parts = getattr(weight, "parts", ())
    if any(isinstance(part, HalfWeight) for part in parts):
        return np.concatenate([matmul_16bit_numpy(x, part) if isinstance(part, HalfWeight) else
                               matmul_q_numpy(x, part, activations) for part in parts], axis=1)
    x = fake_quantize_activations(np.asarray(x, dtype=np.float32), activations)
    return float_matmul(x, np.ascontiguousarray(weight.dequantize().T)).astype(np.float32)


def bf16_tiles_ready(library=None) -> bool:
    """Whether this machine's host kernels run prompt rows on AMX-BF16 tiles (matmul_q_bf16)."""
    return _asks(library, "ember_bf16_tiles_ready")


def bf16_prompts_ready(library=None) -> bool:
    """Whether this machine's host kernels run matmul_q_bf16: on AMX-BF16 tiles, or on AVX512-BF16
    vectors (the avx512vnni path on a CPU that has them: Zen 4)."""
    return _asks(library, "ember_bf16_prompts_ready")


def _asks(library, name: str) -> bool:
    library = library or _host.active()
    function = getattr(library.lib, name, None) if library is not None else None
    return bool(function and function())


def matmul_q_bf16(x: np.ndarray, weight: PackedWeight | StackedWeight | HalfWeight, library=None) -> np.ndarray:
    """x [M, K] @ weight[N, K]^T -> [M, N] on AMX-BF16 tiles or AVX512-BF16 vectors (cpu/matmul_bf16.h): x and W
    rounded to bf16, sums in float32 over the whole of K; a 16-bit part multiplies x as it is.
    The engine's kernel for prompt rows where bf16_prompts_ready(); ValueError elsewhere."""
    library = library or _host.active()
    if not bf16_prompts_ready(library):
        raise ValueError("matmul_q_bf16: this machine's host kernels have neither AMX-BF16 tiles nor AVX512-BF16")
    _check(x, weight)
    if x.dtype != np.float32 or x.strides[-1] != 4:
        x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = weight.shape
    out = np.empty((x.shape[0], rows), dtype=np.float32)
    parts = weight_parts(weight)
    status = library.lib.ember_matmul_parts_bf16(x.ctypes.data, x.shape[0], cols, x.strides[0] // 4,
                                                  ctypes.addressof(parts), len(parts), out.ctypes.data, rows)
    if status:
        raise RuntimeError(f"ember_matmul_parts_bf16 failed with status {status}")
    return out


def round_to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 as the kernel's VCVTNE2PS2BF16 rounds them: subnormal
    floats as zero, nearest even on the bits, NaN kept quiet."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    bits = np.where(np.abs(a) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), a), a).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    rounded = np.where(np.isnan(a), (bits >> np.uint32(16)) | np.uint32(0x40), rounded)
    return (rounded.astype(np.uint32) << np.uint32(16)).view(np.float32)


def matmul_q_bf16_numpy(x: np.ndarray, weight: PackedWeight | StackedWeight | HalfWeight) -> np.ndarray:
    """The NumPy twin of matmul_q_bf16: bf16(x) @ bf16(W)^T summed in float64, W as the twin
    dequantizes it. Equal to the kernel within float32 summation (the tiles round their sums as
    the hardware does)."""
    _check(x, weight)
    x = np.asarray(x, dtype=np.float32)
    outputs = [matmul_16bit_numpy(x, part) if isinstance(part, HalfWeight) else
               (round_to_bf16(x).astype(np.float64) @ round_to_bf16(part.dequantize()).astype(np.float64).T)
               .astype(np.float32) for part in weight.parts]
    return np.concatenate(outputs, axis=1)


# --- weight-only CUDA path: cuda/matmul_q.cu and its NumPy twins ----------------------------
def matmul_q_cuda(x, weight: DeviceQuantizedWeight, out_dtype=None, deterministic: bool = False):
    """The kernels' launch: the GEMV for up to GEMV_MAX_ROWS rows, else dequantized slices of W
    (dequantize_range) times x by cuBLAS, in float32 when the output is float32. deterministic:
    the GEMV whatever the rows, since a row's sums there do not depend on M (the same operations
    for 1 or 4 rows a read), while cuBLAS picks its algorithm, and the scratch rounds W, by M."""
    _check_device(x, weight)
    xp = array_module(x)
    out_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
    if out_dtype not in (x.dtype, np.float32):
        raise ValueError(f"matmul_q: output dtype {out_dtype} is neither x's ({x.dtype}) nor float32")
    rows, (n, k) = x.shape[0], weight.shape
    if x.strides[-1] != x.itemsize or (x.strides[0] // x.itemsize) % 8 or _address(x) % 16:
        x = xp.ascontiguousarray(x)               # the GEMV loads x 16 (8) bytes at a time
    out = xp.empty((rows, n), dtype=out_dtype)
    if rows == 0:
        return out
    if rows > GEMV_MAX_ROWS and not deterministic:
        return _matmul_dequantized(x, weight, out)
    rows_per_read = 1 if rows == 1 else 4
    f32out = "_f32out" if out_dtype == np.float32 and x.dtype != np.float32 else ""
    fmt = _FORMAT_NAMES[weight.qtype]
    grid = (-(-rows // rows_per_read), -(-n // GEMV_ROWS_PER_BLOCK))
    kernel("matmul_q.cu", f"matmul_q_{fmt}_r{rows_per_read}{f32out}", x.dtype)(
        grid, (THREADS,), (out, x, weight.quants, weight.scales, i32(rows), i32(n), i32(k),
                           i32(x.strides[0] // x.itemsize)))
    return out


def matmul_q_cuda_numpy(x, weight: DeviceQuantizedWeight, out_dtype=None):
    """The NumPy twin of matmul_q_cuda: x @ W^T in float32, W dequantized from the same blocks;
    above GEMV_MAX_ROWS rows W is rounded to a 16-bit output's dtype first, as its scratch is
    (what quantization="none" serves on the device anyway)."""
    _check_device(x, weight)
    out_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
    w = weight.dequantize()
    if x.shape[0] > GEMV_MAX_ROWS:
        w = w.astype(out_dtype).astype(np.float32)
    return (np.asarray(x, dtype=np.float32) @ w.T).astype(out_dtype)


def dequantize_rows_numpy(weight: DeviceQuantizedWeight, ids, dtype=np.float32):
    """The NumPy twin of the dequantize kernels: rows `ids` of W in `dtype`."""
    return weight.dequantize(np.asarray(ids)).astype(dtype)


def _dequantize_rows_kernel(weight: DeviceQuantizedWeight, ids, dtype):
    xp = array_module(ids)
    ids = xp.ascontiguousarray(ids.reshape(-1), dtype=np.int32)
    out = xp.empty((ids.shape[0], weight.shape[1]), dtype=dtype)
    if ids.shape[0]:
        kernel("matmul_q.cu", f"dequantize_rows_{_FORMAT_NAMES[weight.qtype]}", dtype)(
            (-(-ids.shape[0] // (THREADS // 32)),), (THREADS,),
            (out, weight.quants, weight.scales, ids, i32(ids.shape[0]), i32(weight.shape[1])))
    return out


def _matmul_dequantized(x, weight: DeviceQuantizedWeight, out):
    """out = x @ W^T by slices of W's rows dequantized into one scratch matrix (cuBLAS GEMMs)."""
    xp = array_module(x)
    n, k = weight.shape
    compute = out.dtype
    x = x.astype(compute, copy=False)
    slice_rows = max(1, min(n, SCRATCH_BYTES // (k * compute.itemsize)))
    scratch = xp.empty((slice_rows, k), dtype=compute)
    dequantize = kernel("matmul_q.cu", f"dequantize_range_{_FORMAT_NAMES[weight.qtype]}", compute)
    for start in range(0, n, slice_rows):
        count = min(slice_rows, n - start)
        dequantize((-(-count // (THREADS // 32)),), (THREADS,),
                   (scratch, weight.quants, weight.scales, i32(start), i32(count), i32(k)))
        out[:, start:start + count] = x @ scratch[:count].T
    return out


def _address(array) -> int:
    return array.ctypes.data if isinstance(array, np.ndarray) else array.data.ptr


def _check_device(x, weight: DeviceQuantizedWeight) -> None:
    if x.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"matmul_q: x {x.shape} does not match weight {weight.shape}")


def _check(x, weight: PackedWeight | StackedWeight | HalfWeight | DequantizedWeight) -> None:
    if not isinstance(weight, HOST_WEIGHTS):
        raise ValueError(f"matmul_q needs a PackedWeight (ops/pack.py to_kernel_format), a StackedWeight, "
                         f"a HalfWeight or a DequantizedWeight, got {type(weight).__name__}")
    if x.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"matmul_q: x {x.shape} does not match weight {weight.shape}")
    if not isinstance(weight, DequantizedWeight) and not all(p.data.flags.c_contiguous for p in weight.parts):
        raise ValueError("matmul_q: weight blocks must be C-contiguous")
