"""Host kernels of cpu/elementwise.c (RMSNorm, residual + RMSNorm, SiLU*up, GELU-tanh*up, RoPE)
and cpu/sampling.c (k-th largest, argmax) against their NumPy twins, on every ISA path this CPU can run, through the public ops."""
import numpy as np
import pytest

from ember_cupy import ops
from ember_cupy.ops import _host, activation, norm, rotary

RUNNABLE = [isa for isa in _host.ISA_FLAGS if isa == "portable" or isa in _host.supported_isas()]


@pytest.fixture(params=RUNNABLE)
def host(request, monkeypatch):
    library = _host.load_library(request.param)
    monkeypatch.setattr(_host, "active", lambda: library)
    return library


@pytest.mark.parametrize("rows", [1, 3, 9, 40])
def test_rms_norms_equal_the_twins(host, rows):
    rng = np.random.default_rng(rows)
    wide = rng.standard_normal((rows, 600)).astype(np.float32) * 3
    x = wide[:, 10:586]                       # strided rows, like a view
    weight = rng.standard_normal(576).astype(np.float32)
    np.testing.assert_allclose(ops.rms_norm(x, weight, 1e-5), norm.rms_norm_numpy(x, weight, 1e-5),
                               rtol=2e-6, atol=2e-6)
    residual = rng.standard_normal((rows, 576)).astype(np.float32)
    got = ops.fused_add_rms_norm(x.copy(), residual.copy(), weight, 1e-5)
    want = norm.fused_add_rms_norm_numpy(x.copy(), residual.copy(), weight, 1e-5)
    np.testing.assert_array_equal(got[1], want[1])                 # residual += x: exact
    np.testing.assert_allclose(got[0], want[0], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", [1, 5, 17])
def test_silu_and_mul_equals_the_twin(host, rows):
    rng = np.random.default_rng(rows)
    gate_up = (rng.standard_normal((rows, 2 * 1539)) * 8).astype(np.float32)   # odd width: the tail
    gate_up[0, :4] = [-100.0, 100.0, 0.0, -0.0]
    np.testing.assert_allclose(ops.silu_and_mul(gate_up), activation.silu_and_mul_numpy(gate_up),
                               rtol=3e-6, atol=1e-30)


@pytest.mark.parametrize("rows", [1, 5, 17])
def test_gelu_tanh_and_mul_equals_the_twin(host, rows):
    rng = np.random.default_rng(rows)
    gate_up = (rng.standard_normal((rows, 2 * 1539)) * 4).astype(np.float32)   # odd width: the tail
    gate_up[0, :8] = [-100.0, 100.0, 0.0, -0.0, -9.0, 9.0, 1e20, -1e20]
    got = ops.gelu_tanh_and_mul(gate_up)
    with np.errstate(over="ignore"):                  # the twin's g^3 at 1e20
        np.testing.assert_allclose(got, activation.gelu_tanh_and_mul_numpy(gate_up), rtol=1e-5, atol=1e-5)
    gate, up = gate_up[:, :1539].astype(np.float64), gate_up[:, 1539:].astype(np.float64)
    with np.errstate(over="ignore"):                  # exact in float64 as a sigmoid: no 1 + tanh cancellation
        exact = gate / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3))) * up
    # the tiny tail of negative gates kept; atol: the vector exp stops at e^88 (gate -100: 6e-37, not 0)
    np.testing.assert_allclose(got, exact, rtol=2e-5, atol=1e-15)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("tokens", [1, 4, 12])
def test_rope_equals_the_twin_on_views_into_a_fused_qkv(host, is_neox, tokens):
    rng = np.random.default_rng(tokens)
    heads, kv_heads, dim = 9, 3, 64
    cache = ops.rope_cos_sin_cache(dim, 4096, 1e5)
    positions = rng.integers(0, 4096, tokens).astype(np.int32)

    def fused():
        qkv = rng.standard_normal((tokens, (heads + 2 * kv_heads) * dim)).astype(np.float32)
        q = qkv[:, :heads * dim].reshape(tokens, heads, dim)
        k = qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
        return qkv, q, k

    state = rng.bit_generator.state
    qkv, q, k = fused()
    ops.apply_rope(q, k, positions, cache, is_neox=is_neox)
    rng.bit_generator.state = state
    twin_qkv, twin_q, twin_k = fused()
    rotary.apply_rope_numpy(twin_q, twin_k, positions, cache, is_neox=is_neox)
    np.testing.assert_array_equal(qkv, twin_qkv)        # same float32 steps: bitwise; v untouched


def test_rope_refuses_positions_outside_the_cache(host):
    cache = ops.rope_cos_sin_cache(8, 16, 1e4)
    q, k = np.zeros((1, 1, 8), np.float32), np.zeros((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="position"):
        ops.apply_rope(q, k, np.array([16], np.int32), cache)


def argmax_cases():
    """Odd widths (below, at and past a 16-lane vector), ties, NaN first / last / everywhere,
    +-inf, rows of -inf only, a strided view."""
    rng = np.random.default_rng(5)
    cases = []
    for vocab in (1, 7, 16, 17, 33, 5000, 262147):
        x = rng.standard_normal((6, vocab)).astype(np.float32)
        x[1, ::3] = 4.0                                # ties: the first wins
        x[2, 0] = np.nan
        x[3, :] = np.nan
        x[3, -1] = -np.inf
        x[4, :] = -np.inf
        x[5, vocab // 2] = np.inf
        x[5, -1] = np.nan
        cases.append(x)
    wide = rng.standard_normal((3, 700)).astype(np.float32)
    cases.append(wide[:, 5:650])
    return cases


def test_argmax_equals_the_twin(host):
    from ember_cupy.engine.sampler import argmax_ignoring_nan, argmax_ignoring_nan_numpy
    for x in argmax_cases():
        np.testing.assert_array_equal(argmax_ignoring_nan(x), argmax_ignoring_nan_numpy(x), err_msg=str(x.shape))
    assert list(argmax_ignoring_nan(np.array([[1, np.nan, 2], [np.nan] * 3, [-np.inf] * 3], np.float32))) == [2, 0, 0]


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_kth_largest_equals_the_twin(host, rows):
    from ember_cupy.engine.sampler import kth_largest, kth_largest_numpy
    rng = np.random.default_rng(rows)
    logits = rng.standard_normal((rows, 5000)).astype(np.float32)
    logits[:, ::7] = 1.5                          # ties at the threshold
    logits[0, :3] = -np.inf
    ks = [int(k) for k in rng.choice([1, 7, 40, 256, 4999, 5000], rows)]
    np.testing.assert_array_equal(kth_largest(logits, ks), kth_largest_numpy(logits, ks))
