"""Every CUDA kernel on the device against its NumPy twin, in float32/float16/bfloat16, with the
kernels' outputs in poisoned memory (NaN bytes), so an element a kernel fails to write shows.

Each case builds host inputs rounded to the dtype; the device runs them in that dtype, the twin in
float32 from the same rounded values. Used by tools/gpu_check.py (real CuPy on the device; the
stand-in cupy in the CPU dry run, whose `empty` poisons every allocation itself).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ember_cupy import ops
from ember_cupy.engine import sampler
from ember_cupy.ops import attention
from ember_cupy.ops._kernel import array_module
from ember_cupy.structured.bitmask import apply_token_bitmask

DTYPES = ("float32", "float16", "bfloat16")
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}   # rtol = atol, per dtype


def _dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _randn(rng, shape, dtype: str) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32).astype(_dtype(dtype))


def poison_pool(xp, shapes_dtypes) -> None:
    """Hand NaN-filled blocks of the outputs' sizes back to CuPy's memory pool, so the next
    allocations of those sizes reuse them (the pool serves a size from its freed blocks)."""
    if not hasattr(xp, "get_default_memory_pool"):
        return
    blocks = [xp.full(int(np.prod(shape)) * np.dtype(dt).itemsize, 0xFF, np.uint8) for shape, dt in shapes_dtypes]
    del blocks


def _paged_batch(put, rng, contexts, queries, block_size, heads, kv_heads, head_dim, dtype):
    blocks = [-(-c // block_size) for c in contexts]
    total = sum(blocks) + 2
    ids = rng.permutation(total)
    tables = np.full((len(contexts), max(blocks) + 1), total - 1, np.int32)
    used = 0
    for s, n in enumerate(blocks):
        tables[s, :n], used = ids[used:used + n], used + n
    starts = np.concatenate([[0], np.cumsum(queries)]).astype(np.int32)
    qkv = put(_randn(rng, (int(starts[-1]), (heads + 2 * kv_heads) * head_dim), dtype))
    q = qkv[:, :heads * head_dim].reshape(-1, heads, head_dim)          # a strided view, as served
    caches = [put(_randn(rng, (total, block_size, kv_heads, head_dim), dtype)) for _ in range(2)]
    return [q, *caches, put(tables), put(np.asarray(contexts, np.int32)), put(starts)]


def _rope_args(put, rng, dtype, neox):
    qkv = put(_randn(rng, (9, 15 * 64), dtype))
    q, k = qkv[:, :9 * 64].reshape(9, 9, 64), qkv[:, 9 * 64:12 * 64].reshape(9, 3, 64)
    positions = put(rng.integers(0, 500, 9).astype(np.int32))
    return [q, k, positions, put(ops.rope_cos_sin_cache(64, 500, 10000.0)), neox]


def _write_kv_args(put, rng, dtype):
    qkv = put(_randn(rng, (9, 9 * 64), dtype))
    key, value = qkv[:, :3 * 64].reshape(9, 3, 64), qkv[:, 3 * 64:6 * 64].reshape(9, 3, 64)
    caches = [put(_randn(rng, (5, 4, 3, 64), dtype)) for _ in range(2)]
    return [key, value, *caches, put(np.array([3, -1, 0, 19, 7, 8, -1, 12, 1], np.int32))]


def _bitmask_args(put, rng, dtype):
    logits = put(rng.standard_normal((4, 1000), dtype=np.float32))
    mask = rng.integers(-2**31, 2**31, (2, 32), dtype=np.int64).astype(np.int32)
    return [logits, mask, np.array([3, 1], np.int32)]      # the mask and rows travel from the host


def _sampling_batch(rng, vocab: int, rows: int):
    """Rows of every sampler branch (greedy, temperature, top-k, top-p, min_p, penalties, bias,
    logprobs) on NaN / +inf / smooth logits; the batch is host data, as the sampler builds it."""
    from ember_cupy import SamplingParams
    from ember_cupy.engine.sampling_batch import build_batch
    from ember_cupy.engine.sequence import Sequence
    kinds = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.7, top_k=40, top_p=0.9),
             dict(temperature=1.0, top_p=0.95), dict(temperature=1.1, min_p=0.05), dict(temperature=0.9, top_k=20),
             dict(temperature=0.6, top_p=0.5, min_p=0.02), dict(temperature=0.0, repetition_penalty=1.3)]
    seqs = []
    for i in range(rows):
        params = SamplingParams(**kinds[i % len(kinds)], frequency_penalty=0.3 * (i % 2), presence_penalty=0.2,
                                logit_bias={5: 3.0, 7: -2.0}, logprobs=5 if i % 3 == 0 else None)
        seq = Sequence(f"g{i}", rng.integers(0, vocab, 20).tolist(), params, 64)
        seq.token_ids += rng.integers(0, vocab, 10).tolist()
        seqs.append(seq)
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * 3
    logits[1, ::97] = np.nan
    logits[2, [3, 9]] = np.inf
    return logits, build_batch(seqs, vocab, [0], rng.random(rows))


def _sampling_args(put, rng):
    logits, batch = _sampling_batch(rng, 49152, 16)
    return [put(logits), batch]


def _one_hot(xp, shape, ids, values):
    """ids [rows, n] marked with values in a [rows, vocab] array: a different id is an error >= 1/21."""
    out = xp.zeros(shape, dtype=np.float32)
    out[xp.arange(shape[0])[:, None], ids] = values
    return out


def _sampled_tokens(logits, batch):
    """The sampled tokens as one-hot rows (a neighbouring id must not pass a relative tolerance)."""
    xp = array_module(logits)
    return _one_hot(xp, logits.shape, sampler.sample_tokens(logits, batch)[:, None], 1.0)


def _raw_logprobs(logits, batch):
    """Top-5 logprobs (values, ids one-hot by rank) and the sampled token's, of the logprob rows."""
    xp = array_module(logits)
    ids, values, chosen = sampler.raw_logprobs(logits, batch, sampler.sample_tokens(logits, batch))
    ranks = xp.asarray(np.arange(1, ids.shape[1] + 1, dtype=np.float32))[None, :].repeat(ids.shape[0], axis=0)
    return [values, chosen, _one_hot(xp, (ids.shape[0], logits.shape[1]), ids, ranks)]


def _split_keys_op(split_keys: int, deterministic: bool = False):
    """ops.paged_attention with decode parts of `split_keys` keys (the twin ignores it), every
    row through the decode kernel when deterministic."""
    def paged_attention_split(*args):
        with attention.decode_split_keys(split_keys):
            return ops.paged_attention(*args, deterministic=deterministic)
    return paged_attention_split


def cases(dtype: str):
    """(name, op, build(put, rng) -> args, indices of mutated args or None, output shapes to poison).
    `put` turns a host array into the operand (device copy, or float32 for the twin); views such as
    q inside a fused qkv are taken after it, as the model takes them."""
    row = lambda shape: lambda put, rng: [put(_randn(rng, shape, dtype))]  # noqa: E731
    norm = lambda put, rng: [put(_randn(rng, (7, 576), dtype)), put(_randn(rng, (576,), dtype)), 1e-5]  # noqa: E731
    fused = lambda put, rng: [put(_randn(rng, (7, 576), dtype)), *norm(put, rng)]  # noqa: E731
    yield "rms_norm", ops.rms_norm, norm, None, [((7, 576), dtype)]
    yield "fused_add_rms_norm", ops.fused_add_rms_norm, fused, [0, 1], []
    yield "silu_and_mul", ops.silu_and_mul, row((7, 3072)), None, [((7, 1536), dtype)]
    yield "gelu_tanh_and_mul", ops.gelu_tanh_and_mul, row((7, 3072)), None, [((7, 1536), dtype)]
    for neox in (True, False):
        yield (f"rotary(neox={neox})", ops.apply_rope,
               lambda put, rng, neox=neox: _rope_args(put, rng, dtype, neox), [0, 1], [])
    yield "write_kv", ops.write_kv, lambda put, rng: _write_kv_args(put, rng, dtype), [2, 3], []
    for heads in ((9, 3, 64), (32, 4, 128)):
        for window in (0, 32):
            def build(put, rng, heads=heads, window=window):
                batch = _paged_batch(put, rng, [1, 17, 300, 50, 129], [1, 1, 1, 13, 129], 16, *heads, dtype)
                return [*batch, heads[2] ** -0.5, window]
            yield (f"paged_attention{heads}, window {window}", ops.paged_attention, build, None,
                   [((1 + 1 + 1 + 13 + 129, heads[0], heads[2]), dtype)])
    # head dims 64/128/256 (templated decode, tiled prefill) and 80 (generic), decode parts of
    # a few keys (many parts and merges), and every row through the decode kernel (deterministic)
    for heads, split_keys, deterministic in (((9, 3, 64), 8, False), ((16, 2, 128), 40, False),
                                             ((8, 2, 256), 64, False), ((6, 2, 80), 1000, False),
                                             ((9, 3, 64), 16, True)):
        def build(put, rng, heads=heads):
            batch = _paged_batch(put, rng, [1, 17, 300, 70, 200], [1, 1, 1, 70, 37], 5, *heads, dtype)
            return [*batch, heads[2] ** -0.5, 24]
        mode = ", deterministic" if deterministic else ""
        yield (f"paged_attention{heads}, parts of {split_keys} keys, pages of 5, window 24{mode}",
               _split_keys_op(split_keys, deterministic), build, None,
               [((1 + 1 + 1 + 70 + 37, heads[0], heads[2]), dtype)])
    if dtype == "float32":   # the bitmask kernel masks float32 logits only
        yield "apply_token_bitmask", apply_token_bitmask, lambda put, rng: _bitmask_args(put, rng, dtype), [0], []
        yield "apply_logit_edits", sampler.apply_logit_edits, _sampling_args, [0], []
        yield "sample_rows", _sampled_tokens, _sampling_args, None, []
        yield "raw_logprobs", _raw_logprobs, _sampling_args, None, []
    yield from quantized_cases(dtype)


def _quantized_weight(put, rng, qtype: str, n: int, k: int):
    """Random blocks in the device layout of cuda/matmul_q.cu (any bytes are valid blocks); the
    twin's put turns the f16 scales into float32, exactly."""
    from ember_cupy.quant import DeviceQuantizedWeight
    if qtype in ("Q4_K", "Q6_K"):
        return _k_quant_weight(put, rng, qtype, n, k)
    quants = rng.integers(0, 256, (n, k if qtype == "Q8_0" else k // 2), dtype=np.uint8)
    shape = (n, k // 32, 2) if qtype == "Q4_1" else (n, k // 32)
    scales = (rng.standard_normal(shape, dtype=np.float32) * 1e-3).astype(np.float16)   # |w| <~ 0.3, as in models
    return DeviceQuantizedWeight(qtype, put(quants), put(scales), (n, k))


def _k_quant_weight(put, rng, qtype: str, n: int, k: int):
    """Random K-quant blocks in the device layout (uint8 quants and headers as stored), their f16
    d (and Q4_K's dmin) at 1e-3 so that |w| stays below ~0.1; any other bytes are valid."""
    from ember_cupy.quant import DEVICE_FORMATS, DeviceQuantizedWeight
    head = 16 if qtype == "Q4_K" else 18
    quants = rng.integers(0, 256, (n, k // 256 * (DEVICE_FORMATS[qtype] - head)), dtype=np.uint8)
    scales = rng.integers(0, 256, (n, k // 256, head), dtype=np.uint8)
    scale = np.array([1e-3], np.float16).view(np.uint8)
    for offset in ((0, 2) if qtype == "Q4_K" else (16,)):
        scales[..., offset:offset + 2] = scale
    return DeviceQuantizedWeight(qtype, put(quants), put(scales), (n, k))


def quantized_cases(dtype: str):
    """matmul_q: the GEMV (1 and 4 rows a read, up to 8 rows), the dequantize + cuBLAS path (64
    rows), float32 logits from 16-bit x; embedding rows dequantized on the device. Q4_K and Q6_K
    (blocks of 256) at K = 768, the others at K = 576."""
    from ember_cupy.ops.linear import embedding, matmul_q
    for qtype in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"):
        k = 768 if qtype.endswith("_K") else 576
        for rows in (1, 3, 8, 64):
            yield (f"matmul_q {qtype} M={rows}", matmul_q,
                   lambda put, rng, q=qtype, m=rows, k=k: [put(_randn(rng, (m, k), dtype)),
                                                           _quantized_weight(put, rng, q, 1000, k)],
                   None, [((rows, 1000), dtype)])
        for rows in (3, 64):
            yield (f"matmul_q {qtype} M={rows} float32 logits", matmul_q,
                   lambda put, rng, q=qtype, m=rows, k=k: [put(_randn(rng, (m, k), dtype)),
                                                           _quantized_weight(put, rng, q, 1000, k), None, 1, np.float32],
                   None, [((rows, 1000), "float32")])
        yield (f"embedding {qtype}", embedding,
               lambda put, rng, q=qtype, k=k: [_quantized_weight(put, rng, q, 1000, k),
                                               put(np.array([999, 0, 17, 17], np.int32)), _dtype(dtype)],
               None, [((4, k), dtype)])


def check_all(xp, to_host, dtypes=DTYPES) -> list[dict]:
    """Run every case; one result dict per (case, dtype) with the max error against the twin."""
    return [_check_one(xp, to_host, *case, dtype) for dtype in dtypes for case in cases(dtype)]


def _check_one(xp, to_host, name, op, build, mutated, outputs, dtype) -> dict:
    twin_args = build(_twin_put, np.random.default_rng(15))
    device_args = build(xp.asarray, np.random.default_rng(15))      # the same values
    result = {"kernel": name, "dtype": dtype}
    try:
        poison_pool(xp, outputs)
        got = op(*device_args)
        want = op(*twin_args)
        if mutated is not None:
            got, want = [device_args[i] for i in mutated], [twin_args[i] for i in mutated]
        got = [to_host(g).astype(np.float32) for g in (got if isinstance(got, (list, tuple)) else [got])]
        want = [np.asarray(w, dtype=np.float32) for w in (want if isinstance(want, (list, tuple)) else [want])]
        tol = TOLERANCE[dtype] * (2 if "attention" in name or "fused" in name else 1)
        error = max(_max_rel_error(g, w) for g, w in zip(got, want))
        same_nonfinite = all(np.array_equal(g[~np.isfinite(w)], w[~np.isfinite(w)], equal_nan=True)
                             and np.isfinite(g[np.isfinite(w)]).all() for g, w in zip(got, want))
        result.update(max_rel_error=error, tolerance=tol, passed=bool(same_nonfinite and error <= tol))
    except Exception as error:  # noqa: BLE001 -- reported per case, the check goes on
        result.update(passed=False, error=f"{type(error).__name__}: {error}")
    return result


def _max_rel_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / (1 + |want|) over the twin's finite values (-inf where a mask wrote it)."""
    finite = np.isfinite(want) & np.isfinite(got)
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(got[finite] - want[finite]) / (1 + np.abs(want[finite]))))


def _twin_put(array: np.ndarray) -> np.ndarray:
    """The twin's operand: float32 from the dtype-rounded values; integers as they are."""
    return array.astype(np.float32) if array.dtype.kind == "f" or array.dtype == _dtype("bfloat16") else array.copy()
