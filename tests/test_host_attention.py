"""The host paged attention (cpu/attention.c) against its NumPy twin, on every ISA path this CPU
can run, for float32 and float16 KV caches; batch invariance; the 16-bit KV cache end to end."""
import numpy as np
import pytest

from ember_cupy.ops import _host, paged_attention, write_kv
from ember_cupy.ops.attention import paged_attention_host, paged_attention_numpy

RUNNABLE = [isa for isa in _host.ISA_FLAGS if isa == "portable" or isa in _host.supported_isas()]
BLOCK_SIZE = 16


@pytest.fixture(scope="module", params=RUNNABLE)
def library(request):
    return _host.load_library(request.param)


def make_batch(rng, seqs, num_kv_heads=3, group=3, head_dim=64, dtype=np.float32, num_blocks=None,
               padding_blocks=3):
    """seqs: (context_len, q_len) per sequence. Pages in a random (non-contiguous) order, each
    table padded with `padding_blocks` entries past its context holding garbage ids; q a strided
    view into a fused qkv. Returns the arguments of paged_attention, and the same tables with
    the garbage replaced by block 0 (the twin gathers padded entries of shorter sequences)."""
    needed = sum(-(-ctx // BLOCK_SIZE) for ctx, _ in seqs)
    num_blocks = num_blocks or needed + 7
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    v_cache = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    width = max(-(-ctx // BLOCK_SIZE) for ctx, _ in seqs) + padding_blocks
    free = list(rng.permutation(num_blocks))
    garbage = np.array([-1, num_blocks, 1 << 30, -(1 << 30)], np.int32)
    tables = garbage[rng.integers(0, len(garbage), (len(seqs), width))]
    clean = np.zeros_like(tables)
    for s, (ctx, _) in enumerate(seqs):
        used = -(-ctx // BLOCK_SIZE)
        tables[s, :used] = clean[s, :used] = [free.pop() for _ in range(used)]
    query_lens = [q_len for _, q_len in seqs]
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_heads = num_kv_heads * group
    qkv = rng.standard_normal((int(query_start_loc[-1]), (num_heads + 2 * num_kv_heads) * head_dim),
                              dtype=np.float32)
    q = qkv[:, :num_heads * head_dim].reshape(-1, num_heads, head_dim)
    context_lens = np.array([ctx for ctx, _ in seqs], np.int32)
    return (q, k_cache, v_cache, tables, context_lens, query_start_loc, head_dim ** -0.5), clean


def assert_matches_twin(library, args, clean_tables, dtype, window=0):
    ours = paged_attention_host(*args, library=library, window=window)
    assert_near_twin(ours, args, clean_tables, dtype, window)
    return ours


def assert_near_twin(ours, args, clean_tables, dtype, window=0):
    """`ours`, a kernel's output for `args`, is the twin's within float32 (float16 pages) rounding."""
    q, k_cache, v_cache, tables, context_lens, query_start_loc, scale = args
    twin = paged_attention_numpy(q, k_cache, v_cache, clean_tables, context_lens, query_start_loc, scale,
                                 window)
    assert ours.dtype == np.float32 and ours.shape == q.shape
    tolerance = 1e-5 if dtype == np.float32 else 2e-5
    largest = np.abs(twin[np.isfinite(twin)]).max(initial=0.0)
    np.testing.assert_allclose(ours, twin, rtol=tolerance, atol=tolerance * largest)   # NaN where NaN


DECODES = [(1, 1), (15, 1), (16, 1), (17, 1), (433, 1), (700, 1), (256, 1), (257, 1), (64, 1)]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_batch_of_mixed_lengths(library, dtype, group, head_dim):
    rng = np.random.default_rng(group * 1000 + head_dim)
    args, clean = make_batch(rng, DECODES, group=group, head_dim=head_dim, dtype=dtype)
    assert_matches_twin(library, args, clean, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("head_dim", [64, 128, 72, 20])
def test_whole_prefill(library, dtype, head_dim):
    """q_len = context_len; 72 and 20 exercise the partial-register and the scalar head_dim paths."""
    rng = np.random.default_rng(head_dim)
    args, clean = make_batch(rng, [(300, 300)], head_dim=head_dim, dtype=dtype)
    assert_matches_twin(library, args, clean, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_chunked_prefills_mixed_with_decodes(library, dtype, group):
    """Chunks whose queries start mid-context (one shorter than a query tile with a long
    context, so split into key ranges), whole short prompts, and decodes, in one batch."""
    rng = np.random.default_rng(group)
    seqs = [(1, 1), (700, 45), (33, 1), (600, 7), (17, 17), (416, 1), (129, 128), (5, 5), (300, 1)]
    args, clean = make_batch(rng, seqs, group=group, dtype=dtype)
    assert_matches_twin(library, args, clean, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("window", [1, 5, 16, 100, 128, 129, 512])
def test_sliding_window_equals_the_twin(library, dtype, window):
    """Decodes, whole prompts and chunks, with contexts shorter and longer than the window and
    split into key ranges (one query tile) or not; head_dim 20 takes the scalar path."""
    rng = np.random.default_rng(window)
    seqs = [(1, 1), (700, 45), (33, 1), (600, 7), (17, 17), (416, 1), (129, 128), (300, 300), (1000, 1)]
    args, clean = make_batch(rng, seqs, group=2, dtype=dtype)
    windowed = assert_matches_twin(library, args, clean, dtype, window)
    full = paged_attention_host(*args, library=library)
    assert (window >= 1000) == np.array_equal(windowed, full)
    args, clean = make_batch(rng, [(40, 40), (90, 1)], group=1, head_dim=20, dtype=dtype)
    assert_matches_twin(library, args, clean, dtype, window)


WIDE_X86 = [isa for isa in RUNNABLE if isa.startswith("avx512")]


@pytest.mark.skipif(not WIDE_X86 or "avx2" not in RUNNABLE, reason="needs an AVX-512 CPU")
@pytest.mark.parametrize("isa", WIDE_X86 or ["none"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("group, head_dim", [(1, 64), (2, 256), (3, 72), (4, 64), (5, 40), (7, 128), (8, 256)])
def test_the_avx512_builds_give_the_avx2_path_bits(isa, dtype, group, head_dim):
    """A query's heads are updated 4 at a time there (2 on avx2: registers), each row with a lone
    row's steps: the same bits, NaN keys and windows included (the NEON paths match avx2's)."""
    rng = np.random.default_rng(group * 1000 + head_dim)
    seqs = [(1, 1), (700, 45), (33, 1), (129, 128), (300, 300), (90, 1)]
    args, _ = make_batch(rng, seqs, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)
    args[1][args[3][1, 2], 5, 1, 3] = np.nan
    wide, narrow = _host.load_library(isa), _host.load_library("avx2")
    for window in (0, 100):
        with np.errstate(invalid="ignore"):
            np.testing.assert_array_equal(paged_attention_host(*args, library=wide, window=window),
                                          paged_attention_host(*args, library=narrow, window=window))


def _cache_row(clean_tables, seq, position):
    """(block, offset) of a sequence's key at `position`."""
    return clean_tables[seq, position // BLOCK_SIZE], position % BLOCK_SIZE


def assert_matches_twin_non_finite(library, args, clean_tables, dtype):
    """The twin warns on inf - inf and the like; NaN and inf must sit where the twin has them."""
    with np.errstate(invalid="ignore", over="ignore"):
        return assert_matches_twin(library, args, clean_tables, dtype)


NON_FINITE_SEQS = [(40, 1), (300, 1), (50, 20), (200, 40)]   # decodes (one split), one- and multi-tile chunks


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("cache", ["k", "v"])
@pytest.mark.parametrize("head_dim", [64, 20])
def test_a_non_finite_key_or_value_gives_the_twins_result(library, dtype, value, cache, head_dim):
    """One NaN or inf element in a K or V row every query of its sequence sees: each ISA path
    (SIMD or scalar head_dim) puts NaN and inf where the twin's dense softmax does."""
    rng = np.random.default_rng(head_dim)
    args, clean = make_batch(rng, NON_FINITE_SEQS, group=2, head_dim=head_dim, dtype=dtype)
    poisoned = args[1] if cache == "k" else args[2]
    for seq, (ctx, q_len) in enumerate(NON_FINITE_SEQS):
        block, offset = _cache_row(clean, seq, int(rng.integers(0, ctx - q_len + 1)))
        poisoned[block, offset, rng.integers(0, poisoned.shape[2]), rng.integers(0, head_dim)] = value
    ours = assert_matches_twin_non_finite(library, args, clean, dtype)
    assert not np.isfinite(ours).all() or (cache == "k" and np.isinf(value))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_keys_scoring_minus_inf_weigh_nothing(library, dtype):
    """Keys whose score is -inf (a chunk of them, a split part of them, a whole context) get
    weight 0 as in the twin: 0 times their V row, so an inf there gives NaN in its dimension and
    the rest of the row is finite; a row of only such keys is 0/0 = NaN."""
    rng = np.random.default_rng(13)
    seqs = [(100, 1), (300, 1), (64, 1), (80, 20)]
    minus_inf_keys = [40, 200, 64, 35]            # the first keys of each sequence
    args, clean = make_batch(rng, seqs, group=2, dtype=dtype)
    q, k_cache, v_cache, starts = args[0], args[1], args[2], args[5]
    q[..., 0] = np.abs(q[..., 0]) + 0.1           # q.k = -inf where k[0] = -inf
    for seq, keys in enumerate(minus_inf_keys):
        for position in range(keys):
            k_cache[(*_cache_row(clean, seq, position), slice(None), 0)] = -np.inf
        v_cache[(*_cache_row(clean, seq, 5), 0, 7)] = np.inf    # KV head 0 = query heads 0 and 1
    ours = assert_matches_twin_non_finite(library, args, clean, dtype)
    for seq, ((ctx, _), keys) in enumerate(zip(seqs, minus_inf_keys)):
        rows = ours[starts[seq]:starts[seq + 1]]
        expected_nan = np.zeros(rows.shape, bool)
        expected_nan[:, :2, 7] = True
        np.testing.assert_array_equal(np.isnan(rows), True if keys == ctx else expected_nan)


def test_float16_cache_is_the_twin_on_the_same_rounded_values(library):
    """The f16 result differs from the f32 one only by the caches' rounding."""
    rng = np.random.default_rng(7)
    args, clean = make_batch(rng, DECODES + [(200, 40)], dtype=np.float16)
    half = assert_matches_twin(library, args, clean, np.float16)
    q, k16, v16, tables, lens, starts, scale = args
    full = paged_attention_host(q, k16.astype(np.float32), v16.astype(np.float32), tables, lens, starts,
                                scale, library)
    np.testing.assert_allclose(half, full, rtol=1e-5, atol=1e-5 * np.abs(full).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_batch_invariance(library, dtype):
    """A sequence's result is bitwise the same alone and among 15 others of any length."""
    rng = np.random.default_rng(11)
    others = [(int(ctx), 1) for ctx in rng.integers(1, 800, 12)] + [(90, 90), (500, 20), (40, 3)]
    for target in [(700, 1), (17, 1), (300, 300), (640, 9)]:
        for position in (0, 7, 15):
            seqs = others[:position] + [target] + others[position:]
            args, _ = make_batch(rng, seqs, dtype=dtype, num_blocks=1024)
            q, k_cache, v_cache, tables, lens, starts, scale = args
            batched = paged_attention_host(*args, library=library)
            rows = slice(starts[position], starts[position + 1])
            alone = paged_attention_host(
                np.ascontiguousarray(q[rows]), k_cache, v_cache, tables[position:position + 1],
                lens[position:position + 1], np.array([0, rows.stop - rows.start], np.int32), scale,
                library)
            np.testing.assert_array_equal(alone, batched[rows], err_msg=f"{target} at {position}")


def _one_sequence(q, k_cache, v_cache, table, scale, library, context, queries, window):
    """The `queries` last queries of a sequence with `context` keys, computed in one call."""
    rows = np.ascontiguousarray(q[context - queries:context])
    return paged_attention_host(rows, k_cache, v_cache, table, np.array([context], np.int32),
                                np.array([0, queries], np.int32), scale, library, window=window)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("window", [0, 100, 333])
def test_a_query_gives_the_same_bits_in_any_chunk(library, dtype, window):
    """Determinism across prefix-cache hits and chunked-prefill splits: a query's result does not
    depend on how many queries of its sequence run with it (a whole prompt, a chunk of any size,
    a decode): keys are reduced in a fixed tiling from position 0."""
    rng = np.random.default_rng(5)
    context = 700
    args, _ = make_batch(rng, [(context, context)], group=3, dtype=dtype)
    q, k_cache, v_cache, table, _, _, scale = args
    whole = _one_sequence(q, k_cache, v_cache, table, scale, library, context, context, window)
    for position in (0, 15, 16, 127, 128, 129, 300, 511, 699):
        for queries in (1, 7, 16, 17, 40, 129):
            end = min(context, position + queries - queries // 2)    # position somewhere inside
            queries = min(queries, end)
            if not end - queries <= position < end:
                continue
            chunk = _one_sequence(q, k_cache, v_cache, table, scale, library, end, queries, window)
            np.testing.assert_array_equal(chunk[position - (end - queries)], whole[position],
                                          err_msg=f"query {position} in a chunk of {queries} ending at {end}")


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_thread_count_does_not_change_results(dtype):
    """Work is split by the sequence's own lengths only: 1 thread gives the same bits as many,
    and the twin's result (the calling thread alone runs both the items and the merges)."""
    library = _host.load_library()
    rng = np.random.default_rng(3)
    args, clean = make_batch(rng, DECODES + [(300, 300), (640, 9)], dtype=dtype)
    library.lib.ember_set_num_threads(1)
    try:
        one = assert_matches_twin(library, args, clean, dtype)
    finally:
        library.lib.ember_set_num_threads(library.threads)
    many = paged_attention_host(*args, library=library)
    np.testing.assert_array_equal(one, many)


def test_dispatch_runs_the_host_kernel_on_numpy_arrays():
    library = _host.active()
    if library is None:
        pytest.skip("host kernels are off here")
    rng = np.random.default_rng(5)
    args, _ = make_batch(rng, [(40, 1), (70, 30)], dtype=np.float16)
    np.testing.assert_array_equal(paged_attention(*args), paged_attention_host(*args, library=library))


def test_a_block_id_out_of_range_inside_the_context_is_refused(library):
    rng = np.random.default_rng(2)
    args, _ = make_batch(rng, [(40, 1)])
    args[3][0, 2] = args[1].shape[0]               # the context's third block
    with pytest.raises(ValueError, match="block id"):
        paged_attention_host(*args, library=library)


def test_empty_batch(library):
    rng = np.random.default_rng(1)
    (q, k_cache, v_cache, tables, lens, starts, scale), _ = make_batch(rng, [(4, 1)])
    out = paged_attention_host(q[:0], k_cache, v_cache, tables[:0], lens[:0], starts[:1], scale, library)
    assert out.shape == (0, 9, 64)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_write_kv_rounds_into_the_cache_dtype(dtype):
    rng = np.random.default_rng(0)
    k_cache = np.zeros((4, BLOCK_SIZE, 3, 64), dtype)
    v_cache = np.zeros_like(k_cache)
    qkv = rng.standard_normal((5, 15 * 64), dtype=np.float32)
    key = qkv[:, 9 * 64:12 * 64].reshape(5, 3, 64)
    value = qkv[:, 12 * 64:].reshape(5, 3, 64)
    slots = np.array([3, -1, 17, 63, 0], np.int64)
    write_kv(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.reshape(-1, 3, 64), v_cache.reshape(-1, 3, 64)
    keep = slots >= 0
    np.testing.assert_array_equal(flat_k[slots[keep]], key[keep].astype(dtype))
    np.testing.assert_array_equal(flat_v[slots[keep]], value[keep].astype(dtype))
    assert not flat_k[1].any()


# ---- the 16-bit KV cache in the engine ---------------------------------------------------------
E2E_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
               "1, 2, 3, 4,", "Q: What is the boiling point of water?\nA:",
               "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 30]


def test_float16_kv_cache_gives_the_float32_greedy_tokens(make_llm):
    """The real model, prompts prefilled in chunks (64 tokens a step) and batched decodes."""
    from ember_cupy import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for dtype in ("float32", "float16"):
        llm = make_llm(kv_cache_dtype=dtype, kv_cache_memory=64 << 20, max_num_batched_tokens=64)
        assert all(k.dtype == dtype and v.dtype == dtype for k, v in llm.engine.runner.kv_caches)
        runs[dtype] = [out.outputs[0].token_ids for out in llm.generate(E2E_PROMPTS, params)]
        runs[dtype + " blocks"] = llm.engine.runner.num_blocks
    assert runs["float16 blocks"] in (2 * runs["float32 blocks"], 2 * runs["float32 blocks"] + 1)
    for prompt, f32, f16 in zip(E2E_PROMPTS, runs["float32"], runs["float16"]):
        agree = next((i for i, (a, b) in enumerate(zip(f32, f16)) if a != b), len(f32))
        assert agree >= 8, (prompt[:30], agree, f32, f16)


def test_kv_cache_dtype_resolution():
    from ember_cupy.ops.cache import resolve_kv_cache_dtype
    host = _host.active() is not None
    assert resolve_kv_cache_dtype("auto", np.float32, np, "auto") == (np.float16 if host else np.float32)
    assert resolve_kv_cache_dtype("auto", np.float32, np, "q8_0") == (np.float16 if host else np.float32)
    assert resolve_kv_cache_dtype("auto", np.float32, np, "none") == np.float32   # the exact reference
    assert resolve_kv_cache_dtype("float32", np.float32, np, "auto") == np.float32
    assert resolve_kv_cache_dtype("float16", np.float32, np, "none") == np.float16

    class FakeCupy:   # any module other than numpy: the CUDA kernels keep the model dtype
        pass
    assert resolve_kv_cache_dtype("auto", np.float16, FakeCupy, "none") == np.float16
    assert resolve_kv_cache_dtype("float32", np.float16, FakeCupy, "none") == np.float16


def test_kv_cache_dtype_is_validated_and_reaches_the_config_from_the_cli():
    from ember_cupy.cli import build_parser, engine_config
    from ember_cupy.config import EngineConfig
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="bfloat16")
    assert EngineConfig().kv_cache_dtype == "auto"
    for command in ("serve", "generate"):
        args = build_parser().parse_args([command, "--kv-cache-dtype", "float16"])
        assert engine_config(args).kv_cache_dtype == "float16"
    assert engine_config(build_parser().parse_args(["serve"])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])


def test_query_start_loc_past_the_queries_is_refused(library):
    rng = np.random.default_rng(4)
    args, _ = make_batch(rng, [(40, 3)])
    q, k_cache, v_cache, tables, lens, starts, scale = args
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_host(q[:2], k_cache, v_cache, tables, lens, starts, scale, library)
