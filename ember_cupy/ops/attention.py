"""Paged causal attention over a flattened varlen batch (NumPy twin of cuda/attention_decode.cu,
cuda/attention_prefill.cu and of the host kernel cpu/attention.c).

Sequence s owns queries q[query_start_loc[s]:query_start_loc[s+1]], the last q_len tokens of
its context of context_lens[s] tokens; query i sits at position context_len - q_len + i and
attends keys 0..position, or with a sliding window of W > 0 only the W keys
position-W+1..position (Mistral's and Gemma's local layers: HF's `sliding_window`). K/V are read
only through block_tables[s] (padded rows may hold any block id; entries past the context are
masked). Caches may hold float32 or float16 (a 16-bit
KV cache); scores, softmax and the output are computed in float32.

Dispatch: CuPy arrays (or an installed kernel provider) -> the CUDA kernels (decode rows: split-KV
decode kernel + merge; prefill rows: tiled FlashAttention-2 kernel, or the decode kernel too in
deterministic mode); NumPy arrays with
host kernels active -> cpu/attention.c (float32 queries, float32/float16 contiguous caches);
otherwise the NumPy twin `paged_attention_numpy`.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ember_cupy.ops import _cuda, _host
from ember_cupy.ops._kernel import (
    array_module,
    contiguous,
    i32,
    int32_array,
    kernel,
    stride,
)

# Upper bound on score-matrix elements per tile, so a long prefill never allocates GBs.
_MAX_SCORE_ELEMENTS = 1 << 24


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    block_tables: np.ndarray, context_lens: np.ndarray,
                    query_start_loc: np.ndarray, scale: float, window: int = 0,
                    deterministic: bool = False) -> np.ndarray:
    """q [T, Hq, D]; caches [num_blocks, block_size, Hk, D] -> out [T, Hq, D]; window: keys a
    query sees, itself included (0 = all before it). deterministic: on the CUDA kernels, every
    query row through the decode kernel, so that a query gets the same bits whether it is a
    decode or a prefill row (slower prefill); the host kernel and the twin need no flag (the
    host kernel gives every query one reduction order by default)."""
    _check_window(window)
    if _cuda.wants_kernel(q):
        return _paged_attention_kernel(q, k_cache, v_cache, block_tables, context_lens,
                                       query_start_loc, scale, window, deterministic)
    library = _host.active()
    if library is not None and _host_kernel_applies(q, k_cache, v_cache):
        return paged_attention_host(q, k_cache, v_cache, block_tables, context_lens,
                                    query_start_loc, scale, library, window)
    return paged_attention_numpy(q, k_cache, v_cache, block_tables, context_lens,
                                 query_start_loc, scale, window)


def _check_window(window) -> None:
    if int(window) != window or window < 0:
        raise ValueError(f"paged_attention: window must be an int >= 0 (0 = none), got {window!r}")


def _first_visible(position, window: int):
    """The first key a query at `position` sees (arrays broadcast)."""
    return 0 * position if window <= 0 else np.maximum(position - window + 1, 0)


# ---- host kernel (cpu/attention.c) -----------------------------------------------------------
HOST_CACHE_DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}
_HOST_ERRORS = {1: "bad shape", 2: "bad query_start_loc / context_lens", 3: "a block id out of range",
                4: "out of memory"}


def _host_kernel_applies(q, k_cache, v_cache) -> bool:
    return (q.dtype == np.float32 and q.ndim == 3 and q.strides[-1] == 4
            and q.strides[0] % 4 == 0 and q.strides[1] % 4 == 0
            and k_cache.dtype in HOST_CACHE_DTYPES and v_cache.dtype == k_cache.dtype
            and k_cache.shape == v_cache.shape and k_cache.ndim == 4
            and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous)


def paged_attention_host(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                         library=None, window: int = 0) -> np.ndarray:
    """The host kernel: K/V read in place through the block tables, fp32 online softmax."""
    _check_window(window)
    library = library or _host.active()
    if not _host_kernel_applies(q, k_cache, v_cache):
        raise ValueError("paged_attention_host: float32 q with a contiguous last axis and "
                         "contiguous float32/float16 caches of one shape")
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"paged_attention_host: q {q.shape} does not match caches {k_cache.shape}")
    out = np.empty((num_tokens, num_heads, head_dim), dtype=np.float32)
    tables = np.ascontiguousarray(block_tables, dtype=np.int32)
    lens = np.ascontiguousarray(context_lens, dtype=np.int32)
    starts = np.ascontiguousarray(query_start_loc, dtype=np.int32)
    if (tables.ndim != 2 or len(starts) != len(lens) + 1 or len(tables) < len(lens)
            or (len(lens) and int(starts[-1]) > num_tokens)):
        raise ValueError("paged_attention_host: query_start_loc must have num_seqs + 1 entries "
                         "within q's tokens and block_tables a row per sequence")
    if not num_tokens:
        return out
    status = library.lib.ember_paged_attention_window(
        out.ctypes.data, q.ctypes.data, q.strides[0] // 4, q.strides[1] // 4,
        k_cache.ctypes.data, v_cache.ctypes.data, HOST_CACHE_DTYPES[k_cache.dtype], num_blocks,
        block_size, num_heads, num_kv_heads, head_dim,
        tables.ctypes.data, tables.shape[1], tables.shape[1],
        lens.ctypes.data, starts.ctypes.data, len(lens), float(scale), int(window))
    if status:
        raise ValueError(f"ember_paged_attention failed: {_HOST_ERRORS.get(status, status)}")
    return out


# ---- NumPy twin --------------------------------------------------------------------------------
# A query at position p is reduced over the keys [lo, hi): from its first visible key rounded down
# to p + 1 rounded up, at multiples of KEY_SPAN from position 0. The keys in there it does not see
# (future, out of its window, zeros past the context) weigh exactly 0. So every array a query's
# bits pass through has the same length whatever runs with it, and its result does not depend on
# the batch, the chunk or a prefix-cache hit: OpenBLAS computes a GEMM's row alike for any M >= 2
# while its inner dimension stays within one of its blocks (a lone row would take its GEMV, so it
# is computed as two; _attend sums probs @ V a span at a time), and the softmax's sum is NumPy's
# pairwise sum over the row. (A V row a query does not see is still multiplied by 0: a non-finite
# value there makes it NaN, as in a dense masked softmax.)
KEY_SPAN = 128


def paged_attention_numpy(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                          scale, window: int = 0) -> np.ndarray:
    """The reference: K/V pages gathered (cast to float32), a dense softmax per query over its
    key span (above): bit-identical per query whatever else is in the batch."""
    _check_window(window)
    out = np.empty_like(q)
    context_lens, query_start_loc = np.asarray(context_lens), np.asarray(query_start_loc)
    queries = q * np.float32(scale)
    lone, runs = _query_runs(context_lens, query_start_loc, window)
    for (lo, hi), seqs in lone.items():
        for part in _batches(seqs, _MAX_SCORE_ELEMENTS // (k_cache.shape[2] * k_cache.shape[3] * (hi - lo))):
            out[query_start_loc[part]] = _lone_queries(queries, k_cache, v_cache, block_tables,
                                                       context_lens, query_start_loc, part, lo, hi, window)
    for seq, start, stop, lo, hi in runs:
        first_position = int(context_lens[seq]) - int(query_start_loc[seq + 1]) + start
        out[start:stop] = _query_run(queries[start:stop], k_cache, v_cache, block_tables[seq],
                                     int(context_lens[seq]), first_position, lo, hi, window)
    return out


def _key_span(positions, window: int):
    """[lo, hi) of each query position (arrays): the keys it sees, rounded out to KEY_SPAN."""
    return (_first_visible(positions, window) // KEY_SPAN * KEY_SPAN,
            (positions // KEY_SPAN + 1) * KEY_SPAN)


def _query_runs(context_lens, query_start_loc, window: int):
    """({(lo, hi): sequences with one query, of that key span}, [(seq, start, stop, lo, hi)]:
    the consecutive queries of a longer chunk that share a key span)."""
    lone, runs = {}, []
    for seq, ctx in enumerate(context_lens):
        start, stop = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        lo, hi = _key_span(int(ctx) - (stop - start) + np.arange(stop - start), window)
        if stop - start == 1:
            lone.setdefault((int(lo[0]), int(hi[0])), []).append(seq)
            continue
        cuts = [0, *(np.flatnonzero((np.diff(lo) != 0) | (np.diff(hi) != 0)) + 1), stop - start]
        runs += [(seq, start + a, start + b, int(lo[a]), int(hi[a])) for a, b in zip(cuts, cuts[1:])]
    return lone, runs


def _batches(items, size: int):
    size = max(1, size)
    return [items[i:i + size] for i in range(0, len(items), size)]


def _gather_span(cache: np.ndarray, block_table, context_len: int, lo: int, hi: int) -> np.ndarray:
    """A sequence's rows [lo, hi) of `cache` as float32 [hi - lo, Hk, D], zeros past its context."""
    block_size = cache.shape[1]
    end = min(hi, context_len)
    first = lo // block_size
    pages = cache[np.asarray(block_table[first:-(-end // block_size)])]
    rows = pages.reshape(-1, *cache.shape[2:])[lo - first * block_size:end - first * block_size]
    span = np.zeros((hi - lo, *cache.shape[2:]), np.float32)
    span[:end - lo] = rows
    return span


def _masked(positions, lo: int, hi: int, window: int):
    """[queries, hi - lo]: True where the query at `positions` does not see the key."""
    keys = np.arange(lo, hi)[None, :]
    return (keys > positions[:, None]) | (keys < _first_visible(positions[:, None], window))


def _attend(queries, keys, values, masked):
    """queries [..., R, D] (scaled), keys [..., D, L], values [..., L, D], masked broadcasting to
    [..., R, L] -> [..., R, D]."""
    lone = queries.shape[-2] == 1
    if lone:   # as two rows: OpenBLAS's GEMV sums otherwise than its GEMM
        queries = np.concatenate([queries, queries], axis=-2)
    scores = np.matmul(queries, keys)
    np.copyto(scores, np.float32(-np.inf), where=masked)
    probs = _softmax_inplace(scores)
    # probs @ V one KEY_SPAN of keys at a time, left to right: OpenBLAS's kernel for small
    # matrices sums all of K in one pass, its blocked kernel in blocks of a few hundred (384 on
    # Haswell), so past that a row's bits would depend on how many rows run with it
    out = np.matmul(probs[..., :KEY_SPAN], values[..., :KEY_SPAN, :])
    for start in range(KEY_SPAN, probs.shape[-1], KEY_SPAN):
        out += np.matmul(probs[..., start:start + KEY_SPAN], values[..., start:start + KEY_SPAN, :])
    return out[..., :1, :] if lone else out


def _softmax_inplace(scores: np.ndarray) -> np.ndarray:
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def _lone_queries(queries, k_cache, v_cache, block_tables, context_lens, query_start_loc, seqs,
                  lo: int, hi: int, window: int):
    """The one query of each of `seqs` (key span [lo, hi) for all), stacked: [S, Hq, D]."""
    num_seqs, (num_heads, head_dim), num_kv_heads = len(seqs), queries.shape[1:], k_cache.shape[2]
    spans = [(_gather_span(k_cache, block_tables[s], int(context_lens[s]), lo, hi),
              _gather_span(v_cache, block_tables[s], int(context_lens[s]), lo, hi)) for s in seqs]
    keys = np.ascontiguousarray(np.stack([k for k, _ in spans]).transpose(0, 2, 3, 1))    # [S, Hk, D, L]
    values = np.ascontiguousarray(np.stack([v for _, v in spans]).transpose(0, 2, 1, 3))  # [S, Hk, L, D]
    q = queries[query_start_loc[seqs]].reshape(num_seqs, num_kv_heads, -1, head_dim)
    masked = _masked(context_lens[seqs] - 1, lo, hi, window)[:, None, None, :]
    return _attend(np.ascontiguousarray(q), keys, values, masked).reshape(num_seqs, num_heads, head_dim)


def _query_run(queries, k_cache, v_cache, block_table, context_len: int, first_position: int,
               lo: int, hi: int, window: int):
    """Consecutive queries [m, Hq, D] of one sequence from first_position, all of key span
    [lo, hi) -> [m, Hq, D]."""
    m, num_heads, head_dim = queries.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = np.ascontiguousarray(_gather_span(k_cache, block_table, context_len, lo, hi).transpose(1, 2, 0))
    values = np.ascontiguousarray(_gather_span(v_cache, block_table, context_len, lo, hi).transpose(1, 0, 2))
    positions = first_position + np.arange(m)
    out = np.empty((num_kv_heads, m, group, head_dim), np.float32)
    for rows in _batches(np.arange(m), _MAX_SCORE_ELEMENTS // (num_heads * (hi - lo))):
        q = np.ascontiguousarray(queries[rows].reshape(len(rows), num_kv_heads, group, head_dim)
                                 .transpose(1, 0, 2, 3)).reshape(num_kv_heads, -1, head_dim)
        masked = np.repeat(_masked(positions[rows], lo, hi, window), group, axis=0)
        out[:, rows] = _attend(q, keys, values, masked).reshape(num_kv_heads, len(rows), group, head_dim)
    return out.transpose(1, 0, 2, 3).reshape(m, num_heads, head_dim)


# ---- CUDA kernels (cuda/attention_decode.cu, cuda/attention_prefill.cu) ------------------------
# Launch shapes mirror the kernels' constants (named alike there).
DECODE_THREADS, DECODE_TILE, SLOT_FLOATS = 128, 64, 8
TEMPLATED_HEAD_DIMS = (64, 128, 256)   # other head dims: the generic row kernel, head_dim <= 128
GENERIC_MAX_HEAD_DIM = 128
PREFILL_ROWS = 64                      # (token, head) rows per prefill query tile
MERGE_THREADS = 128
# Split-KV, one partition per query (batch invariance): parts of DECODE_SPLIT_KEYS keys at
# multiples from position 0, the span doubled until a row has at most MAX_DECODE_SPLITS parts
# (cuda/attention_decode.cu decode_row). Not tuned on a device: 128 keys (two tiles) keeps a
# lone decode spread over several blocks per KV head, and a part's partial output (written and
# merged) stays small beside the K/V it reads.
DECODE_SPLIT_KEYS, MAX_DECODE_SPLITS = 2 * DECODE_TILE, 32
# Partial outputs of one decode launch at most (rows are launched in groups to stay within it).
PART_WORKSPACE_BYTES = 32 << 20

_split_keys = DECODE_SPLIT_KEYS


@contextlib.contextmanager
def decode_split_keys(keys: int):
    """Decode parts of `keys` keys in the block (tests: many parts and merges on short contexts)."""
    global _split_keys
    if int(keys) != keys or not 1 <= keys <= 1 << 20:
        raise ValueError(f"decode_split_keys: keys must be an int in [1, 2^20], got {keys!r}")
    previous, _split_keys = _split_keys, int(keys)
    try:
        yield
    finally:
        _split_keys = previous


def decode_parts(num_keys: int, first_key: int = 0, split_keys: int | None = None) -> tuple[int, int]:
    """(span, parts) of a query row that sees keys first_key .. num_keys - 1: the kernel's
    decode_row in Python (tests, and the grid bound)."""
    span = split_keys or _split_keys
    while (num_keys - 1) // span - first_key // span + 1 > MAX_DECODE_SPLITS:
        span *= 2
    return span, (num_keys - 1) // span - first_key // span + 1


def grid_splits(max_context: int, split_keys: int | None = None) -> int:
    """Blocks per row and KV head that cover the parts of any row of at most max_context keys
    (the block table's width: no device sync to learn the real lengths)."""
    return max(1, min(MAX_DECODE_SPLITS, -(-max_context // (split_keys or _split_keys))))


def max_decode_group(head_dim: int, itemsize: int) -> int:
    """Query heads per KV head the decode kernel holds (DecodeLayout: segments x head slots)."""
    templated = head_dim in TEMPLATED_HEAD_DIMS
    vec = 16 // itemsize if templated else 1
    vectors = head_dim // vec if templated else GENERIC_MAX_HEAD_DIM
    lanes = min(vectors, 32)
    return DECODE_THREADS // lanes * (SLOT_FLOATS // (vec * (vectors // lanes)))


def _check_kernel_shapes(q, k_cache, v_cache) -> None:
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, cache_dim = k_cache.shape[2:]
    if cache_dim != head_dim or num_heads % num_kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention kernel: q {q.shape} does not match caches {k_cache.shape}, "
                         f"{v_cache.shape}")
    if head_dim not in TEMPLATED_HEAD_DIMS and head_dim > GENERIC_MAX_HEAD_DIM:
        raise ValueError(f"paged_attention kernel: head_dim {head_dim} is neither one of "
                         f"{TEMPLATED_HEAD_DIMS} nor <= {GENERIC_MAX_HEAD_DIM}")
    group, most = num_heads // num_kv_heads, max_decode_group(head_dim, q.dtype.itemsize)
    if group > most:
        raise ValueError(f"paged_attention kernel: group {group} x head_dim {head_dim} exceeds the decode "
                         f"kernel's accumulators (at most {most} query heads per KV head for {q.dtype})")


def _paged_attention_kernel(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                            window: int = 0, deterministic: bool = False):
    """Decode rows -> the decode kernel (split-KV and merge on long contexts), prefill rows -> the
    tiled prefill kernel; every row through the decode kernel when `deterministic` (a query then
    gets the same bits as a decode, a small chunk or a long prefill row) or when head_dim has no
    tiled instantiation (its generic entry). q may be a strided view (e.g. into a fused qkv).
    Every sequence is taken to have at least one query row (the runner's batches do): then rows >
    sequences is the sign that some sequence prefills, with no device sync."""
    xp = array_module(q)
    num_tokens, num_heads, head_dim = q.shape
    _check_kernel_shapes(q, k_cache, v_cache)
    out = xp.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
    if not num_tokens:
        return out
    tables = int32_array(xp, block_tables)
    lens, starts = int32_array(xp, context_lens), int32_array(xp, query_start_loc)
    num_seqs, block_size, num_kv_heads = lens.shape[0], k_cache.shape[1], k_cache.shape[2]
    caches = (contiguous(xp, k_cache, "k_cache"), contiguous(xp, v_cache, "v_cache"))
    batch = (tables, lens, starts, i32(num_seqs), i32(num_heads), i32(num_kv_heads))
    geometry = (block_size, tables.shape[1], scale, window)
    if deterministic or head_dim not in TEMPLATED_HEAD_DIMS:
        _launch_decode(xp, out, q, caches, batch, geometry, num_tokens, all_rows=True)
        return out
    _launch_decode(xp, out, q, caches, batch, geometry, num_seqs, all_rows=False)
    if num_tokens > num_seqs:
        _launch_prefill(out, q, caches, batch, block_size, tables.shape[1], scale, window, num_tokens)
    return out


def _launch_decode(xp, out, q, caches, batch, geometry, rows, all_rows: bool):
    """all_rows False: rows = num_seqs, the decodes (q_len 1); True: rows = num_tokens, every
    query row. Each row's keys split into its own parts (decode_parts) and merged; rows go in
    groups whose partial outputs fit PART_WORKSPACE_BYTES."""
    block_size, max_blocks, scale, window = geometry
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = int(batch[5])
    group = num_heads // num_kv_heads
    split_keys = _split_keys
    splits = grid_splits(max_blocks * block_size, split_keys)
    entry = f"paged_attention_decode_d{head_dim if head_dim in TEMPLATED_HEAD_DIMS else 0}"
    shared_floats = group * DECODE_TILE + group * head_dim + 3 * group + DECODE_TILE
    per_row = num_heads * splits * (head_dim + 2) * 4
    launch_rows = rows if splits == 1 else max(1, min(rows, PART_WORKSPACE_BYTES // per_row))
    if splits > 1:
        part_out = xp.empty((launch_rows, num_heads, splits, head_dim), dtype=np.float32)
        part_stats = xp.empty((launch_rows, num_heads, splits, 2), dtype=np.float32)
    else:
        part_out = part_stats = xp.empty((1,), dtype=np.float32)   # not written
    decode = kernel("attention_decode.cu", entry, q.dtype)
    for row_base in range(0, rows, launch_rows):
        count = min(launch_rows, rows - row_base)
        row_args = (i32(all_rows), i32(row_base), i32(split_keys))
        decode((count, num_kv_heads, splits), (DECODE_THREADS,),
               (out, part_out, part_stats, q, *caches, *batch, i32(head_dim), i32(block_size), i32(max_blocks),
                stride(q, 0), stride(q, 1), np.float32(scale), i32(window), *row_args),
               shared_mem=4 * shared_floats)
        if splits > 1:
            kernel("attention_decode.cu", "paged_attention_merge", q.dtype)(
                (count, num_heads), (MERGE_THREADS,),
                (out, part_out, part_stats, batch[1], batch[2], batch[3], batch[4], i32(head_dim), i32(splits),
                 i32(window), *row_args))


def prefill_keys_per_tile(head_dim: int, itemsize: int) -> int:
    """PrefillLayout::kKeys: K and V tiles together stay within 32 KiB."""
    return 16 if itemsize * head_dim > 512 else 32


def _launch_prefill(out, q, caches, batch, block_size, max_blocks, scale, window, num_tokens):
    """Grid x: an upper bound of the prefill tiles, sum over sequences of ceil(q_len / tokens per
    tile) <= ceil(num_tokens / tokens per tile) + num_seqs; the blocks past the last tile exit."""
    num_heads, head_dim = q.shape[1:]
    num_seqs, num_kv_heads = int(batch[3]), int(batch[5])
    group = num_heads // num_kv_heads
    if group > PREFILL_ROWS:
        raise ValueError(f"paged_attention prefill kernel: group {group} > {PREFILL_ROWS} query rows per tile")
    tokens_per_tile = PREFILL_ROWS // group
    keys = prefill_keys_per_tile(head_dim, q.dtype.itemsize)
    shared = 4 * PREFILL_ROWS * (keys + 4 + 3) + 2 * keys * head_dim * q.dtype.itemsize
    kernel("attention_prefill.cu", f"paged_attention_prefill_d{head_dim}", q.dtype)(
        (-(-num_tokens // tokens_per_tile) + num_seqs, num_kv_heads), (2 * head_dim,),
        (out, q, *caches, *batch, i32(block_size), i32(max_blocks), stride(q, 0), stride(q, 1),
         np.float32(scale), i32(window)),
        shared_mem=shared)
