"""Issue 27: speculative decoding by prompt lookup, through LLM on the real model. Its output is
the plain output token for token (greedy and seeded, with logprobs, stops, penalties, n > 1,
preemption), its KV pages roll back, and the gate follows the measured costs."""
from __future__ import annotations

import pytest
from step_cost_stand_ins import FreeVerification

from ember_cupy import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SOURCE = ("A small, low-dependency LLM inference engine in Python, built on four pillars: continuous "
          "batching, fine-grained scheduling, a paged KV cache with prefix caching, and exact sampling.")
COPY_PROMPT = f"Repeat the following text exactly.\n\nText: {SOURCE}\n\nRepeated text: {SOURCE[:40]}"
FREE_PROMPT = "Write a short story about a lighthouse keeper."


class LinearCosts(FreeVerification):
    """Every token costs its share: a draft never pays."""

    def seconds(self, num_tokens):
        return float(num_tokens)


def _speculating(make_llm, costs=None, **config):
    llm = make_llm(speculative_config=NGRAM, **config)
    llm.engine.speculator.costs = costs or FreeVerification()
    return llm


@pytest.fixture(scope="module")
def plain(checkpoint):
    from ember_cupy import LLM
    return LLM(checkpoint)


@pytest.fixture(scope="module")
def spec(checkpoint):
    from ember_cupy import LLM
    llm = LLM(checkpoint, speculative_config=NGRAM)
    llm.engine.speculator.costs = FreeVerification()
    return llm


def _same_outputs(left, right):
    for a, b in zip(left, right, strict=True):
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            assert x.text == y.text
            assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
            assert x.cumulative_logprob == y.cumulative_logprob
            assert (x.logprobs is None) == (y.logprobs is None)
            for p, q in zip(x.logprobs or (), y.logprobs or (), strict=True):
                assert (p.token_id, p.logprob, p.top) == (q.token_id, q.logprob, q.top)


def _accepted(llm) -> int:
    return llm.engine.spec_decode_stats.num_accepted_tokens


def test_greedy_output_is_the_plain_output_token_for_token(plain, spec):
    prompts = [COPY_PROMPT, FREE_PROMPT, COPY_PROMPT, COPY_PROMPT]
    params = [SamplingParams(temperature=0, max_tokens=48, logprobs=2),
              SamplingParams(temperature=0, max_tokens=32),
              SamplingParams(temperature=0, max_tokens=7),   # ends inside a verification
              SamplingParams(temperature=0, max_tokens=48, stop=["paged KV"])]   # a stop string inside one
    before = _accepted(spec)
    outputs = spec.generate(prompts, params)
    _same_outputs(plain.generate(prompts, params), outputs)
    assert outputs[3].outputs[0].finish_reason == "stop" and outputs[3].outputs[0].stop_reason == "paged KV"
    assert _accepted(spec) - before >= 20   # the copy prompts did speculate


def test_seeded_sampling_with_penalties_forks_and_logprobs_is_the_plain_output(plain, spec):
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=11, n=2, max_tokens=40, min_tokens=30,
                            repetition_penalty=1.05, frequency_penalty=0.5, presence_penalty=1.0, logprobs=1)
    before = _accepted(spec)
    outputs = spec.generate([COPY_PROMPT, FREE_PROMPT], params)
    _same_outputs(plain.generate([COPY_PROMPT, FREE_PROMPT], params), outputs)
    assert _accepted(spec) > before
    again = spec.generate([COPY_PROMPT, FREE_PROMPT], params)   # and reproducible
    _same_outputs(outputs, again)


def test_penalties_at_each_drafted_position_count_the_drafts_before_it(plain, spec):
    """Repetitive text drafts tokens that the frequency and presence penalties then weigh: row j
    of a verification must see drafts 1..j in the output, as decoding would."""
    prompts = ["Say yes forty times: yes yes yes yes yes yes yes yes yes yes yes yes",
               "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"]
    params = [SamplingParams(temperature=0, max_tokens=30, frequency_penalty=0.3),
              SamplingParams(temperature=0, max_tokens=30, presence_penalty=1.0, repetition_penalty=1.1)]
    before = _accepted(spec)
    _same_outputs(plain.generate(prompts, params), spec.generate(prompts, params))
    assert _accepted(spec) - before >= 20


def test_structured_outputs_and_opted_out_requests_never_draft(plain, spec):
    stats = spec.engine.spec_decode_stats
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    params = [SamplingParams(temperature=0, max_tokens=32, structured_outputs={"json": schema}),
              SamplingParams(temperature=0, max_tokens=32, speculative=False)]
    drafts = stats.num_drafts
    outputs = spec.generate([COPY_PROMPT, COPY_PROMPT], params)
    assert stats.num_drafts == drafts
    _same_outputs(plain.generate([COPY_PROMPT, COPY_PROMPT], params), outputs)


def test_rejected_drafts_give_their_pages_back_and_only_accepted_blocks_are_hashed(make_llm):
    """Stepped by hand: between steps each sequence holds the pages of its computed tokens and
    no more, every hashed block holds the sequence's own tokens, and at the end every page is free."""
    llm = _speculating(make_llm, block_size=4, num_kv_blocks=128)
    engine, manager = llm.engine, llm.engine.block_manager
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate([COPY_PROMPT, FREE_PROMPT]):
        engine.add_request(f"r{i}", prompt, params)
    rejected = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            assert len(seq.block_table) == -(-seq.num_computed_tokens // 4)
            for index, digest in enumerate(seq.block_hashes):
                block = manager.blocks[seq.block_table[index]]
                assert block.block_hash in (None, digest)
                if block.block_hash == digest:
                    assert block.token_ids == tuple(seq.token_ids[index * 4:index * 4 + 4])
        stats = engine.spec_decode_stats
        rejected = stats.num_draft_tokens - stats.num_accepted_tokens
    assert rejected > 0 and manager.num_free_blocks == manager.num_blocks


def test_preemption_under_a_small_pool_keeps_the_plain_output(plain, make_llm):
    llm = _speculating(make_llm, block_size=4, num_kv_blocks=40, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [COPY_PROMPT, COPY_PROMPT + " and", COPY_PROMPT + " pillars", COPY_PROMPT + " sampling"]
    outputs = llm.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    _same_outputs(plain.generate(prompts, params), outputs)


def test_the_gate_drafts_when_verification_is_free_and_not_when_each_row_costs_its_share(make_llm):
    params = SamplingParams(temperature=0, max_tokens=24)
    for costs, speculates in ((LinearCosts(), False), (FreeVerification(), True)):
        llm = _speculating(make_llm, costs)
        proposer, calls = llm.engine.speculator.proposer, []
        propose_batch = proposer.propose_batch
        proposer.propose_batch = lambda *args: calls.append(1) or propose_batch(*args)
        llm.generate([COPY_PROMPT], params)
        assert (llm.engine.spec_decode_stats.num_drafts > 0) is speculates
        assert bool(calls) is speculates   # when no draft could pay, the proposer is not even asked


def test_startup_calibration_measures_step_costs(make_llm):
    llm = make_llm(speculative_config=NGRAM, max_num_seqs=4)
    costs = llm.engine.speculator.costs
    assert costs.measured and 0 < costs.seconds(1) < costs.seconds(64)
