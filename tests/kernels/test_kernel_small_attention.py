"""One small case per attention kernel (decode, decode split + merge, tiled prefill), the set CI
also runs under ThreadSanitizer and AddressSanitizer (threads mode, tools/ci_kernels.sh)."""
import numpy as np

from ember_cupy.ops import attention

from .test_kernel_attention import check, make_batch


def test_small_decode_f16():
    rng = np.random.default_rng(50)
    check(*make_batch(rng, [1, 19, 70], [1] * 3, 8, 6, 2, 64, "float16"), "float16")


def test_small_decode_split_and_merge_bf16():
    """Parts of 16 keys: context 1 has one (its blocks past it exit), context 40 three (merged)."""
    rng = np.random.default_rng(51)
    with attention.decode_split_keys(16):
        check(*make_batch(rng, [1, 40], [1, 1], 8, 4, 2, 64, "bfloat16"), "bfloat16")


def test_small_prefill_f32():
    """A chunk of 20 after 9 cached keys, group 4: query tiles of 64 / 4 = 16 tokens, so two tiles,
    over pages of 4 keys and a window of 11; beside a decode."""
    rng = np.random.default_rng(52)
    check(*make_batch(rng, [29, 1], [20, 1], 4, 8, 2, 64, "float32"), "float32", window=11)
