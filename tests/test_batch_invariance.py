"""Seeded sampling gives the same text alone and in a batch of 16 on the CPU fast path: the host
kernels compute every row in an order that does not depend on the batch (issue: a seeded request
at temperature 0.9 changed text among 16 concurrent ones when GEMM reduction order followed the
batch size). On the NumPy path (quantization="none", OpenBLAS) this is not guaranteed."""
import pytest

from ember_cupy import SamplingParams
from ember_cupy.ops import _host

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot",
           "List three colours:", "In 1969, the first", "The best way to learn"]
FILLER = [f"Tell me a story about the number {i} and a {w}." for i, w in
          zip(range(16), "cat dog owl fox elk yak emu ant bee cow hen pig ram rat eel".split())]


@pytest.mark.skipif(_host.active() is None, reason="host kernels unavailable (no C compiler)")
def test_seeded_outputs_are_the_same_alone_and_in_a_batch_of_16(make_llm):
    llm = make_llm(enable_prefix_caching=False)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=24, ignore_eos=True)
              for seed in (1, 7, 42, 2024)]
    for prompt, sampling in zip(PROMPTS, params):
        alone = llm.generate([prompt], sampling)[0].outputs[0].token_ids
        batch = [prompt] + FILLER[:15]
        together = llm.generate(batch, [sampling] + [SamplingParams(temperature=0.8, seed=i, max_tokens=30)
                                                     for i in range(15)])[0].outputs[0].token_ids
        assert together == alone, (prompt, sampling.seed)
