"""One small case per kernel: the set CI also runs under ThreadSanitizer and AddressSanitizer
(threads mode, tools/ci_kernels.sh), where every thread of every block is a real thread."""
import numpy as np
import pytest

from ember_cupy import ops

from .helpers import assert_close, f32, on_kernel, randn
from .test_kernel_attention import check, make_batch
from .test_kernel_rotary import fused_qkv


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_small_norms(dtype):
    rng = np.random.default_rng(20)
    x, residual, weight = randn(rng, (3, 40), dtype), randn(rng, (3, 40), dtype), randn(rng, (40,), dtype)
    assert_close(on_kernel(ops.rms_norm, x, weight, 1e-5), ops.rms_norm(f32(x), f32(weight), 1e-5), dtype)
    want = ops.fused_add_rms_norm(f32(x), f32(residual), f32(weight), 1e-5)
    on_kernel(ops.fused_add_rms_norm, x, residual, weight, 1e-5)
    assert_close(residual, want[1], dtype)
    assert_close(x, want[0], dtype, scale=2)


def test_small_activation_bf16():
    gate_up = randn(np.random.default_rng(21), (2, 100), "bfloat16")
    assert_close(on_kernel(ops.silu_and_mul, gate_up), ops.silu_and_mul(f32(gate_up)), "bfloat16")


@pytest.mark.parametrize("is_neox", [True, False])
def test_small_rope(is_neox):
    rng = np.random.default_rng(22)
    qkv, q, k = fused_qkv(rng, 3, 4, 2, 16, "float32")
    want = qkv.copy()
    want_q, want_k = want[:, :64].reshape(3, 4, 16), want[:, 64:96].reshape(3, 2, 16)
    cache = ops.rope_cos_sin_cache(16, 50, 10000.0)
    positions = np.array([0, 7, 49], np.int32)
    ops.apply_rope(want_q, want_k, positions, cache, is_neox)
    on_kernel(ops.apply_rope, q, k, positions, cache, is_neox)
    assert_close(qkv, want, "float32")


def test_small_write_kv():
    rng = np.random.default_rng(23)
    key, value = randn(rng, (4, 2, 8), "float16"), randn(rng, (4, 2, 8), "float16")
    caches = [randn(rng, (3, 4, 2, 8), "float16") for _ in range(2)]
    want = [c.copy() for c in caches]
    slots = np.array([5, -1, 0, 11], np.int32)
    ops.write_kv(key, value, *want, slots)
    on_kernel(ops.write_kv, key, value, *caches, slots)
    for got, expected in zip(caches, want):
        np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))


def test_small_attention():
    """head_dim 16: the generic row kernel for decode and prefill rows (the templated decode, split
    and tiled prefill kernels: test_kernel_small_attention.py). Under the sanitizers every warp
    shuffle is a barrier of real threads, so one dtype and short contexts."""
    rng = np.random.default_rng(24)
    check(*make_batch(rng, [1, 9, 20], [1, 1, 6], 4, 6, 2, 16, "float16"), "float16")
