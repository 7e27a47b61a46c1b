"""cuda/sampling.cu's apply_token_bitmask against its NumPy twin (ember_cupy/structured/bitmask.py)."""
import numpy as np
import pytest

from ember_cupy.structured import bitmask as B

from .helpers import on_kernel


def random_case(rng, batch, vocab, rows):
    logits = rng.standard_normal((batch, vocab), dtype=np.float32)
    words = (vocab + 31) // 32
    mask = rng.integers(-2**31, 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
    return logits, mask, np.asarray(rows, dtype=np.int32)


@pytest.mark.parametrize("batch,vocab,rows", [(1, 32, [0]), (3, 1000, [2, 0]), (5, 49152, [1, 3, 4]),
                                              (2, 70, [1])])
def test_bitmask_kernel_equals_twin(batch, vocab, rows):
    logits, mask, row_ids = random_case(np.random.default_rng(vocab), batch, vocab, rows)
    want = logits.copy()
    B.apply_token_bitmask_numpy(want, mask, row_ids)
    got = logits.copy()
    on_kernel(B.apply_token_bitmask, got, mask, row_ids)
    np.testing.assert_array_equal(got, want)
    untouched = [r for r in range(batch) if r not in rows]
    np.testing.assert_array_equal(got[untouched], logits[untouched])


def test_twin_reads_llguidance_bit_order():
    logits = np.zeros((1, 40), dtype=np.float32)
    mask = np.array([[(1 << 3) | (1 << 31), 1 << 1]], dtype=np.uint32).view(np.int32)   # 3, 31, 33
    B.apply_token_bitmask_numpy(logits, mask, np.array([0], np.int32))
    assert np.flatnonzero(np.isfinite(logits[0])).tolist() == [3, 31, 33]


def test_narrow_mask_disallows_the_rest():
    """A mask with fewer words than the logits need leaves nothing allowed past its end."""
    logits = np.zeros((1, 70), dtype=np.float32)
    mask = np.full((1, 2), -1, dtype=np.int32)
    want = logits.copy()
    B.apply_token_bitmask_numpy(want, mask, np.array([0], np.int32))
    assert np.isfinite(want[0, :64]).all() and np.isinf(want[0, 64:]).all()
    on_kernel(B.apply_token_bitmask, logits, mask, np.array([0], np.int32))
    np.testing.assert_array_equal(logits, want)


def test_sampler_masks_through_the_kernel(checkpoint):
    """The sampler's grammar mask dispatched to the kernel (CPU shim) picks the same tokens as
    the NumPy twin, and only tokens the grammar allows."""
    from ember_cupy.engine.sampler import Sampler
    from ember_cupy.engine.sequence import Sequence
    from ember_cupy.sampling_params import SamplingParams
    from ember_cupy.structured import StructuredOutputsParams
    from ember_cupy.structured.compiler import GrammarCompiler

    vocab = checkpoint.config.vocab_size
    compiler = GrammarCompiler(checkpoint.tokenizer, vocab)
    constraint = StructuredOutputsParams(regex="[0-9]{4}")
    prompt = checkpoint.tokenizer.encode("Number:")
    logits = np.random.default_rng(0).standard_normal((3, vocab), dtype=np.float32) * 4

    def run(kernel: bool):
        seqs = [Sequence(str(i), prompt, SamplingParams(temperature=t, seed=i), 8,
                         constraint=compiler.new_constraint(constraint) if i != 1 else None)
                for i, t in enumerate((0.0, 1.0, 1.0))]
        sampler = Sampler(checkpoint.config.eos_token_ids)
        grammar = B.token_bitmasks(seqs, vocab)
        if kernel:
            return on_kernel(sampler, logits.copy(), seqs, grammar).token_ids
        return sampler(logits.copy(), seqs, grammar).token_ids

    want = run(kernel=False)
    assert run(kernel=True) == want
    assert want[1] == Sampler(checkpoint.config.eos_token_ids)(   # the unconstrained row: as alone
        logits[1:2].copy(), [Sequence("1", prompt, SamplingParams(temperature=1.0, seed=1), 8)]).token_ids[0]
    for token in (want[0], want[2]):
        assert checkpoint.tokenizer.decode([token]).isdigit()


def test_sampler_device_branch_with_standin_cupy(checkpoint):
    """The sampler's CuPy branch (logits not an np.ndarray: mask on the device, raw logprobs
    copied before it, the on-device greedy path) on the stand-in cupy, NVRTC-compiled kernel run
    through the shim: the same tokens and logprobs as the host branch."""
    from ember_cupy.engine.sampler import Sampler
    from ember_cupy.engine.sequence import Sequence
    from ember_cupy.sampling_params import SamplingParams
    from ember_cupy.structured import StructuredOutputsParams
    from ember_cupy.structured.compiler import GrammarCompiler

    from .shim import standin_cupy

    vocab = checkpoint.config.vocab_size
    compiler = GrammarCompiler(checkpoint.tokenizer, vocab)
    digits = StructuredOutputsParams(regex="[0-9]{4}")
    prompt = checkpoint.tokenizer.encode("Number:")
    logits = np.random.default_rng(1).standard_normal((3, vocab), dtype=np.float32) * 4
    batches = {"greedy": [dict(temperature=0.0)] * 3,
               "mixed": [dict(temperature=0.0, logprobs=2), dict(temperature=1.0, seed=2), dict(temperature=1.0, seed=3)]}

    def run(sampling, device: bool):
        seqs = [Sequence(str(i), prompt, SamplingParams(**s), 8, constraint=compiler.new_constraint(digits) if i != 1 else None)
                for i, s in enumerate(sampling)]
        sampler = Sampler(checkpoint.config.eos_token_ids)
        grammar = B.token_bitmasks(seqs, vocab)
        if not device:
            return sampler(logits.copy(), seqs, grammar)
        with standin_cupy.installed() as cupy:
            return sampler(cupy.asarray(logits), seqs, grammar)

    for name, sampling in batches.items():
        host, device = run(sampling, False), run(sampling, True)
        assert device.token_ids == host.token_ids, name
        assert checkpoint.tokenizer.decode([host.token_ids[0]]).isdigit()
        assert [lp and (lp.token_id, lp.top) for lp in device.logprobs] == \
               [lp and (lp.token_id, lp.top) for lp in host.logprobs]
