"""Seeded sampling gives the same text alone and in a batch of 16 on the CPU fast path: the host
kernels compute every row in an order that does not depend on the batch (issue: a seeded request
at temperature 0.9 changed text among 16 concurrent ones when GEMM reduction order followed the
batch size); and the same bits after a prefix-cache hit or with any chunked-prefill split (the
attention reduces keys in a fixed tiling from position 0; before, a query among at most 16 of its
sequence's took a split-and-merge order, so a cache hit moved the first token's logprobs by up to
0.08 nats). Float matrices (quantization="none") and the NumPy path without host kernels hold it
too, on NumPy's OpenBLAS (ops/linear.py float_matmul, ops/attention.py's twin)."""
import numpy as np
import pytest

from ember_cupy import SamplingParams
from ember_cupy.ops import _host
from tests.test_host_no_compiler import without_compiler  # noqa: F401 (a fixture)

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


def _tokens_and_logprobs_of(completion):
    return completion.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in completion.logprobs]


def _tokens_and_logprobs(output):
    return _tokens_and_logprobs_of(output.outputs[0])


@pytest.mark.skipif(_host.active() is None, reason="host kernels unavailable (no C compiler)")
@pytest.mark.parametrize("kv_cache_dtype", ["float16", "float32"])
def test_a_prefix_cache_hit_or_a_chunked_prefill_gives_the_same_bits(make_llm, kv_cache_dtype):
    """A ~350-token prompt: computed whole, then again with 336 of its tokens from the prefix
    cache, then in chunks of 7 and of 100 tokens: the same token ids and logprobs, bit for bit."""
    prompt = " ".join(f"word{i} apple banana cherry" for i in range(60))
    for sampling in (SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True),
                     SamplingParams(temperature=1.0, seed=3, max_tokens=8, logprobs=5, ignore_eos=True)):
        cached = make_llm(kv_cache_dtype=kv_cache_dtype, max_num_prefill_tokens=1024)
        cold = cached.generate([prompt], sampling)[0]
        warm = cached.generate([prompt], sampling)[0]
        assert cold.num_cached_tokens == 0 and warm.num_cached_tokens >= 320
        expected = _tokens_and_logprobs(cold)
        assert _tokens_and_logprobs(warm) == expected, "prefix-cache hit"
        for chunk in (7, 100):
            chunked = make_llm(kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False,
                               max_num_prefill_tokens=chunk).generate([prompt], sampling)[0]
            assert _tokens_and_logprobs(chunked) == expected, f"chunks of {chunk}"


@pytest.mark.skipif(_host.active() is None, reason="host kernels unavailable (no C compiler)")
def test_forked_choices_are_the_same_bits_alone_and_among_others(make_llm):
    """n=3 seeded: every choice is the same bits run alone and among 8 other requests, and choice
    0 is the n=1 request with the same seed (each choice draws from its own (seed, index) stream)."""
    llm = make_llm()
    forked = SamplingParams(temperature=1.0, seed=99, n=3, max_tokens=10, logprobs=2, ignore_eos=True)
    prompt = PROMPTS[2]

    def choices(output):
        return [_tokens_and_logprobs_of(c) for c in output.outputs]

    alone = choices(llm.generate([prompt], forked)[0])
    assert len(set(map(str, alone))) == 3, "the choices should differ at temperature 1"
    others = [SamplingParams(temperature=0.8, seed=i, max_tokens=12) for i in range(8)]
    among = llm.generate(FILLER[:4] + [prompt] + FILLER[4:8], others[:4] + [forked] + others[4:])[4]
    assert choices(among) == alone
    single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=99, max_tokens=10, logprobs=2,
                                                   ignore_eos=True))[0]
    assert choices(single) == alone[:1]


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


@pytest.mark.skipif(_host.active() is None, reason="host kernels unavailable (no C compiler)")
def test_float_matrices_give_the_same_bits_alone_in_a_batch_after_a_hit_and_in_chunks(make_llm):
    """quantization="none" (float32 matrices through NumPy's OpenBLAS, whose GEMV sums a lone row
    otherwise than its GEMM): decodes alone and in a batch, a prefix-cache hit and chunks of 7 give
    the same token ids and logprobs as the cold whole prompt."""
    prompt = " ".join(f"word{i} apple banana cherry" for i in range(30))
    sampling = SamplingParams(temperature=1.0, seed=5, max_tokens=6, logprobs=3, ignore_eos=True)
    llm = make_llm(quantization="none", max_num_prefill_tokens=1024)
    cold = _tokens_and_logprobs(llm.generate([prompt], sampling)[0])
    assert _tokens_and_logprobs(llm.generate([prompt], sampling)[0]) == cold, "prefix-cache hit"
    others = [SamplingParams(temperature=0.8, seed=i, max_tokens=8) for i in range(3)]
    batch = llm.generate(FILLER[:3] + [prompt], others + [sampling])
    assert _tokens_and_logprobs(batch[3]) == cold, "in a batch"
    chunked = make_llm(quantization="none", enable_prefix_caching=False, max_num_prefill_tokens=7)
    assert _tokens_and_logprobs(chunked.generate([prompt], sampling)[0]) == cold, "chunks of 7"


def test_without_host_kernels_the_numpy_path_gives_the_same_bits_too(without_compiler, make_llm):
    """No C compiler (the NumPy twins, matrices dequantized at load), a second turn: its prompt is
    the first turn's prompt and output, so a prefix-cache hit brings K/V that were computed as
    decodes. Its token ids and logprobs equal those of the same prompt computed cold in one step,
    in chunks of 50, and in a batch of other requests, bit for bit (before, the twin's decode and
    prefill attention summed in different orders)."""
    without_compiler()
    llm = make_llm(max_num_prefill_tokens=1024)
    assert _host.active() is None
    first = llm.tokenizer.encode(" ".join(f"word{i} apple banana" for i in range(20)))
    turn = llm.generate([first], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    second = first + list(turn.outputs[0].token_ids) + first[:9]
    sampling = SamplingParams(temperature=1.0, seed=11, max_tokens=6, logprobs=3, ignore_eos=True)
    warm = llm.generate([second], sampling)[0]
    assert warm.num_cached_tokens >= len(first) + 16
    expected = _tokens_and_logprobs(warm)
    for chunk in (1024, 50):
        cold = make_llm(enable_prefix_caching=False, max_num_prefill_tokens=chunk).generate([second], sampling)[0]
        assert _tokens_and_logprobs(cold) == expected, f"cold, chunks of {chunk}"
    others = [SamplingParams(temperature=0.8, seed=i, max_tokens=8) for i in range(3)]
    batch = llm.generate(FILLER[:3] + [second], others + [sampling])
    assert _tokens_and_logprobs(batch[3]) == expected, "in a batch"
