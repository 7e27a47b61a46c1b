"""Issue 3 on the real model: greedy outputs do not depend on batching, chunking, preemption
or prefix caching; on the host kernels not even their logprobs' bits (issue 25)."""
import pytest

from ember_cupy import SamplingParams
from ember_cupy.ops import _host

SYSTEM = [{"role": "system", "content": "You are a terse assistant. Answer in one short sentence. "
           "Never use lists. Prefer plain words. " * 3}]
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 3 + 4?",
             "What do bees make?", "Which planet is red?", "What is ice made of?",
             "Say hello in Spanish.", "What animal barks?"]
PROMPTS = [f"Fact {i}: the number {i * 7} is" if i % 2 else f"Story {i}: Once upon a time a {w}"
           for i, w in enumerate(["cat", "dog", "fox", "owl", "bee", "cow", "elk", "yak"] * 4)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def bits(output):
    """A completion's token ids and, on the host kernels, every logprob it reports (the NumPy
    twins' OpenBLAS GEMMs round by batch shape)."""
    completion = output.outputs[0]
    if _host.active() is None:
        return completion.token_ids
    return completion.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in completion.logprobs]


@pytest.fixture(scope="module")
def alone(checkpoint):
    from ember_cupy import LLM
    llm = LLM(checkpoint, max_num_seqs=1)
    return [bits(out) for out in llm.generate(PROMPTS, GREEDY)]


def test_batch_of_32_with_chunked_prefill_budget_64(make_llm, alone):
    llm = make_llm(max_num_seqs=32, max_num_batched_tokens=64)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [bits(o) for o in outs] == alone


def test_tiny_kv_pool_preempts_yet_outputs_are_identical(make_llm, alone):
    llm = make_llm(max_num_seqs=32, max_num_batched_tokens=64, block_size=4, num_kv_blocks=24,
                   enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, GREEDY)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [bits(o) for o in outs] == alone
    assert llm.engine.block_manager.num_free_blocks == 24


def test_prefix_caching_on_and_off_agree_and_hits_happen(make_llm):
    convs = [SYSTEM + [{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=10)
    results = {}
    for caching in (False, True):
        llm = make_llm(max_num_seqs=4, enable_prefix_caching=caching)
        results[caching] = llm.chat(convs, params)
        stats = llm.engine.block_manager.prefix_stats
        assert (stats.hits > 0) == caching
    assert [o.outputs[0].token_ids for o in results[True]] == [o.outputs[0].token_ids for o in results[False]]
    cached = [o.num_cached_tokens for o in results[True]]
    assert cached[0] == 0 and min(cached[4:]) >= 48   # later requests reuse the system prompt


def test_a_request_that_can_never_fit_is_rejected_at_admission(make_llm):
    llm = make_llm(block_size=4, num_kv_blocks=10)   # 40 tokens in all
    with pytest.raises(ValueError, match="context"):
        llm.generate("word " * 30, SamplingParams(max_tokens=20))
    assert not llm.engine.has_unfinished_requests()
