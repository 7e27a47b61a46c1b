"""Seeded sampling gives the same text alone and in a batch of 16 on the CPU fast path: the host
kernels compute every row in an order that does not depend on the batch (issue: a seeded request
at temperature 0.9 changed text among 16 concurrent ones when GEMM reduction order followed the
batch size). On the NumPy path (quantization="none", OpenBLAS) this is not guaranteed."""
import numpy as np
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


@pytest.mark.skipif(_host.active() is None, reason="host kernels unavailable (no C compiler)")
def test_prompt_chunks_of_any_size_give_the_same_logprobs_tokens_and_embeddings(make_llm):
    """The CPU computes a step's prompt tokens in chunks of max_num_prefill_tokens (issue 24): a
    prompt cut at 7 tokens a step scores, samples and embeds exactly as in one step."""
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=4, logprobs=3, prompt_logprobs=5, ignore_eos=True)
    prompts = [PROMPTS[0] + " " + FILLER[0], FILLER[1] + " " + FILLER[2]]
    outputs = {}
    for chunk in (7, 1024):
        llm = make_llm(enable_prefix_caching=False, max_num_prefill_tokens=chunk)
        generated = llm.generate(prompts, params)
        outputs[chunk] = ([(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in generated],
                          [o.embedding for o in llm.embed(prompts)])
    (chunked, chunked_embeddings), (whole, whole_embeddings) = outputs[7], outputs[1024]
    assert chunked == whole
    assert all(np.array_equal(a, b) for a, b in zip(chunked_embeddings, whole_embeddings))
