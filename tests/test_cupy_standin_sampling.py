"""Sampling on the device through the public API: `LLM.generate` on the default model with the
CuPy backend (the stand-in cupy: NumPy buffers that are not np.ndarray, real NVRTC, cuda/sampling.cu
run by the CPU shim) gives the NumPy backend's tokens and logprobs for seeded temperature, top-p,
top-k, min_p, penalties, logit_bias, min_tokens and logprobs, and copies no logits row back."""
from __future__ import annotations

import numpy as np
import pytest

from ember_cupy import LLM, SamplingParams
from ember_cupy.engine import device_sampler
from ember_cupy.engine.sampler import Sampler

from kernels.shim import standin_cupy

PROMPTS = ["The capital of France is", "Once upon a time"]
SUITE = [
    SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=2, max_tokens=4, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.95, seed=3, max_tokens=4, ignore_eos=True),
    SamplingParams(temperature=1.2, min_p=0.05, seed=4, max_tokens=4, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=0.9, seed=5, max_tokens=4, repetition_penalty=1.3, frequency_penalty=0.5,
                   presence_penalty=0.4, logit_bias={13: 3.0, 28: -50.0}, min_tokens=3, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, repetition_penalty=1.2, logprobs=5),
    SamplingParams(temperature=1.0, top_k=5, seed=6, n=2, max_tokens=3, ignore_eos=True),
]


def generate(path):
    """Every prompt under every params, in one batch (rows of all kinds share each step)."""
    llm = LLM(path, max_num_batched_tokens=128, block_size=16, num_kv_blocks=32, quantization="none",
              dtype="float32")
    outputs = llm.generate([p for _ in SUITE for p in PROMPTS], [s for s in SUITE for _ in PROMPTS])
    results = []
    for output in outputs:
        for completion in output.outputs:
            entries = completion.logprobs or []
            results.append((list(completion.token_ids), [(e.token_id, e.logprob, e.top) for e in entries]))
    return results, llm


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """The default GGUF's first 2 blocks, bit-identical (tools/cut_gguf.py): its real tokenizer,
    embedding and vocabulary (49152), at a cost the CPU shim can run in CI."""
    import sys

    from ember_cupy.model.loader import default_model_path
    from ember_cupy.ops import _cuda
    sys.path.insert(0, str(_cuda.CUDA_SOURCE_DIR.parent / "tools"))
    from cut_gguf import cut_gguf
    path = tmp_path_factory.mktemp("cut") / "cut2.gguf"
    cut_gguf(default_model_path(), str(path), 2)
    return str(path)


@pytest.fixture(scope="module")
def numpy_results(model_path):
    return generate(model_path)[0]


@pytest.fixture(scope="module")
def device_run(model_path):
    """The suite on the stand-in, recording every device-to-host copy the sampler makes and
    every sampling kernel launched."""
    copies, launches = [], []
    in_sampler = [False]
    get, sample_rows = standin_cupy.ndarray.get, Sampler._sample_rows

    def recording_get(self, *args, **kwargs):
        if in_sampler[0]:
            copies.append(self.nbytes)
        return get(self, *args, **kwargs)

    def recording_sample_rows(self, logits, seqs, grammar):
        in_sampler[0] = True
        try:
            return sample_rows(self, logits, seqs, grammar)
        finally:
            in_sampler[0] = False

    def counted(name):
        launch = getattr(device_sampler, name)

        def call(*args):
            launches.append(name)
            return launch(*args)
        return call
    with pytest.MonkeyPatch.context() as patch, standin_cupy.installed() as cupy:
        patch.setattr(standin_cupy.ndarray, "get", recording_get)
        patch.setattr(Sampler, "_sample_rows", recording_sample_rows)
        for name in ("apply_logit_edits_kernel", "sample_tokens_kernel", "raw_logprobs_kernel"):
            patch.setattr(device_sampler, name, counted(name))
        results, llm = generate(model_path)
        assert llm.engine.runner.xp is cupy
        vocab = llm.engine.model_config.vocab_size
    return results, copies, launches, vocab


def test_device_sampling_gives_the_numpy_backends_tokens_and_logprobs(numpy_results, device_run):
    results, _, _, _ = device_run
    assert len(results) == len(numpy_results) == sum(len(PROMPTS) * p.n for p in SUITE)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(results, numpy_results):
        assert tokens == want_tokens
        assert len(logprobs) == len(want_logprobs)
        for (token, value, top), (want_token, want_value, want_top) in zip(logprobs, want_logprobs):
            assert token == want_token
            assert value == pytest.approx(want_value, abs=2e-3)   # host C kernels vs the shim: both fp32
            assert [t for t, _ in top] == [t for t, _ in want_top]
            np.testing.assert_allclose([v for _, v in top], [v for _, v in want_top], atol=2e-3)
    assert any(len(set(tokens)) > 1 for tokens, _ in results)


def test_the_device_branch_ran_and_copied_back_no_logits_row(device_run):
    _, copies, launches, vocab = device_run
    assert {"apply_logit_edits_kernel", "sample_tokens_kernel", "raw_logprobs_kernel"} <= set(launches)
    assert copies, "the sampler copied nothing back"
    # token ids (4 bytes a row), logprobs (at most 20 a row): no copy is near a logits row
    rows = sum(len(PROMPTS) * p.n for p in SUITE)
    assert max(copies) <= rows * device_sampler.MAX_TOP_LOGPROBS * 4 < vocab * 4
