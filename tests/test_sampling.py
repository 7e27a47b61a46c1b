"""Sampling: distributions on a small fake vocabulary, and every parameter on the real model."""
import numpy as np
import pytest

from ember_cupy import SamplingParams
from ember_cupy.engine.sampler import Sampler
from ember_cupy.engine.sequence import Sequence

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], dtype=np.float32)
CHI2_CRITICAL_7DOF_P001 = 24.32


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _expected(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The filtered distribution, computed independently of the sampler (vLLM's semantics:
    top-p applies to the top-k distribution renormalised)."""
    probs = _softmax(LOGITS / temperature)
    order = np.argsort(-probs)
    if top_k:
        probs = np.where(np.isin(np.arange(len(probs)), order[:top_k]), probs, 0.0)
        probs /= probs.sum()
    keep = np.zeros_like(probs, dtype=bool)
    mass = 0.0
    for token in order:
        if probs[token] == 0 or mass >= top_p:
            break
        keep[token] = True
        mass += probs[token]
    keep &= probs >= min_p * probs.max()
    filtered = np.where(keep, probs, 0.0)
    return filtered / filtered.sum()


def _draw(params: SamplingParams, count=8000):
    sampler = Sampler(eos_token_ids=())
    rng = lambda i: np.random.default_rng(i) if params.seed is None else None  # noqa: E731
    seqs = [Sequence(f"s{i}", [0], params, 10, rng=rng(i)) for i in range(count)]
    tokens = sampler(np.tile(LOGITS, (count, 1)), seqs).token_ids
    return np.bincount(tokens, minlength=len(LOGITS))


@pytest.mark.parametrize("filters", [dict(), dict(temperature=0.7), dict(top_p=0.8), dict(top_p=0.5, temperature=1.3),
                                     dict(min_p=0.2), dict(top_k=3), dict(top_k=5, top_p=0.9, min_p=0.05)])
def test_empirical_distribution_matches_the_filtered_softmax(filters):
    counts = _draw(SamplingParams(**{"temperature": 1.0, **filters}))
    expected = _expected(**filters) * counts.sum()
    assert counts[expected == 0].sum() == 0, "a filtered-out token was sampled"
    support = expected > 0
    chi2 = (((counts - expected)[support]) ** 2 / expected[support]).sum()
    assert chi2 < CHI2_CRITICAL_7DOF_P001, (filters, counts, expected.round())


def test_negative_and_huge_seeds_are_fine():
    counts = [_draw(SamplingParams(seed=seed), count=50) for seed in (-5, 2**70)]
    assert all(c.sum() == 50 for c in counts)


def test_top_k_one_equals_greedy(make_llm):
    llm = make_llm()
    prompt = "The best thing about mornings is"
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    top1 = llm.generate(prompt, SamplingParams(temperature=1.3, top_k=1, seed=3, max_tokens=12))[0]
    assert top1.outputs[0].token_ids == greedy


def test_seeded_sampling_is_independent_of_the_batch(make_llm):
    llm = make_llm(max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.9, top_p=0.9, min_p=0.02, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate("A poem about rain:", params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True)
    batch = llm.generate(["Hi", "A poem about rain:", "Count: 1 2 3"], [others, params, others])
    assert batch[1].outputs[0].token_ids == alone


def test_n_samples_share_the_prompt_and_differ(make_llm):
    llm = make_llm(block_size=4)
    prompt = "My favourite animal is the"   # several blocks, the last one partial: copy-on-write
    out = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    again = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    greedy = llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=8))[0]
    assert len({tuple(o.token_ids) for o in greedy.outputs}) == 1
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_logprobs_are_sorted_and_include_the_sampled_token(make_llm):
    llm = make_llm()
    out = llm.generate("Water boils at", SamplingParams(temperature=0.8, seed=1, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry.token_id == token and entry.logprob <= 0
        values = [v for _, v in entry.top]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry.logprob <= values[0] + 1e-6
    assert out.cumulative_logprob == pytest.approx(sum(e.logprob for e in out.logprobs))


def test_prompt_logprobs_score_every_prompt_token(make_llm):
    llm = make_llm()
    ids = llm.tokenizer.encode("The capital of France is Paris")
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    assert [e.token_id for e in out.prompt_logprobs[1:]] == ids[1:]
    assert out.prompt_logprobs[-1].logprob > -2.0  # "Paris" is likely after that prefix


def test_logit_bias_forces_and_bans_tokens(make_llm):
    llm = make_llm()
    forced = llm.tokenizer.encode(" banana")[0]
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, logit_bias={forced: 100}))[0]
    assert out.outputs[0].token_ids == [forced] * 4
    greedy = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=1))[0]
    first = greedy.outputs[0].token_ids[0]
    banned = llm.generate("The capital of France is",
                          SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100}))[0]
    assert banned.outputs[0].token_ids[0] != first


def test_penalties_reduce_repetition(make_llm):
    llm = make_llm()
    prompt = "Repeat after me: la la la la la la la"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    for params in [dict(repetition_penalty=1.8), dict(frequency_penalty=2.0)]:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **params))[0]
        repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731
        assert repeats(out.outputs[0].token_ids) < repeats(plain.token_ids), params


@pytest.mark.parametrize("penalty,expected", [
    (dict(presence_penalty=0.9), 0),        # 3.0 - 0.9 still leads
    (dict(presence_penalty=1.1), 1),        # applied once, whatever the count
    (dict(frequency_penalty=0.4), 1),       # 3 occurrences x 0.4 = 1.2
    (dict(frequency_penalty=0.3), 0),
    (dict(repetition_penalty=1.5), 1),      # 3.0 / 1.5 = 2.0 < 2.5 (prompt tokens count too)
])
def test_penalty_arithmetic_on_a_fake_vocabulary(penalty, expected):
    logits = np.array([[3.0, 2.0, 1.0, 0.0]], dtype=np.float32)
    params = SamplingParams(temperature=0, **penalty)
    seq = Sequence("s", [3], params, 10)
    seq.token_ids += [0, 0, 0]              # token 0 generated three times
    if "repetition_penalty" in penalty:
        logits[0, 1] = 2.5
    assert Sampler(eos_token_ids=())(logits, [seq]).token_ids == [expected]


def test_min_tokens_holds_back_eos(make_llm):
    llm = make_llm()
    chat = [{"role": "user", "content": "Reply with just: OK"}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert short.finish_reason == "stop"
    minimum = len(short.token_ids) + 5
    held = llm.chat(chat, SamplingParams(temperature=0, max_tokens=60, min_tokens=minimum))[0].outputs[0]
    assert len(held.token_ids) >= minimum
    assert not set(held.token_ids[:minimum]) & set(llm.engine.model_config.eos_token_ids)


def test_ignore_eos_runs_to_max_tokens(make_llm):
    llm = make_llm()
    chat = [{"role": "user", "content": "Reply with just: OK"}]
    out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 20


def test_every_output_carries_request_stats(make_llm):
    llm = make_llm(max_num_batched_tokens=16)
    outs = llm.generate(["A B C D E F G H I J K L M N O P Q R S T", "Hi"],
                        SamplingParams(temperature=0, max_tokens=3))
    for out in outs:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.queue_time >= 0 and m.time_to_first_token >= m.prefill_time >= 0
        assert m.num_preemptions == 0 and out.num_cached_tokens == m.num_cached_tokens == 0
