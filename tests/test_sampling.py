"""Sampling: distributions on a small fake vocabulary, and every parameter on the real model."""
import numpy as np
import pytest

from ember_cupy import SamplingParams
from ember_cupy.engine.sampler import Sampler, apply_logit_edits
from ember_cupy.engine.sampling_batch import build_batch
from ember_cupy.engine.sequence import Sequence

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], dtype=np.float32)
CHI2_CRITICAL_7DOF_P001 = 24.32


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _expected(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The filtered distribution, computed independently of the sampler (vLLM v1's semantics:
    min_p relative to the largest probability, then top-k, then top-p on the distribution
    renormalised over what those two left)."""
    probs = _softmax(LOGITS / temperature)
    order = np.argsort(-probs)
    probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
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
    filtered = np.where(keep, probs, 0.0)
    return filtered / filtered.sum()


def _draw(params: SamplingParams, count=8000):
    sampler = Sampler(eos_token_ids=())
    rng = lambda i: np.random.default_rng(i) if params.seed is None else None  # noqa: E731
    seqs = [Sequence(f"s{i}", [0], params, 10, rng=rng(i)) for i in range(count)]
    tokens = sampler(np.tile(LOGITS, (count, 1)), seqs).token_ids
    return np.bincount(tokens, minlength=len(LOGITS))


@pytest.mark.parametrize("filters", [dict(), dict(temperature=0.7), dict(top_p=0.8), dict(top_p=0.5, temperature=1.3),
                                     dict(min_p=0.2), dict(top_k=3), dict(top_k=5, top_p=0.9, min_p=0.05),
                                     # min_p before top-p (vLLM): min_p leaves tokens 0-4, renormalised the
                                     # mass before token 4 is 0.942 >= 0.92, so it goes (top-p first would keep it)
                                     dict(top_p=0.92, min_p=0.1)])
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


# --- the filter without a full sort equals a brute-force full sort ---------------------------
def _reference_filter(row, top_k, top_p, min_p):
    """vLLM's filtering by brute force: a full stable sort (lower id first among equal logits),
    min_p against the top probability, top-k keeping every token tied with the k-th logit, then
    top-p on what is left renormalised: a token stays while the mass before it is below top_p."""
    order = np.argsort(-row, kind="stable")
    probs = np.exp(row - row.max())
    keep = probs >= np.float32(min_p) if min_p else np.ones(len(row), dtype=bool)
    if 0 < top_k < len(row):
        keep &= row >= row[order[top_k - 1]]
    kept = order[keep[order]]
    p = probs[kept].astype(np.float64)
    if top_p < 1.0:
        before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
        kept, p = kept[before < top_p * p.sum()], p[before < top_p * p.sum()]
    return {int(t): float(q) for t, q in zip(kept, p) if q > 0}


def _random_rows(vocab, seed):
    """Smooth, peaked, flat and heavily tied rows, so every candidate size and tie path is used."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(vocab) * scale for scale in (0.02, 0.5, 1.5, 4.0)]
    rows += [np.round(rng.standard_normal(vocab) * 2), np.round(rng.standard_normal(vocab) * 0.3),
             rng.integers(-3, 3, vocab).astype(float)]
    heavy = rng.standard_normal(vocab) * 0.5
    heavy[rng.choice(vocab, 30, replace=False)] += 6.0       # a few dominant tokens above a flat tail
    return [r.astype(np.float32) for r in rows + [heavy]]


FILTER_COMBOS = [(k, p, m) for k in (0, 1, 2, 5, 40, 300) for p in (1.0, 0.999, 0.95, 0.5, 0.1)
                 for m in (0.0, 0.01, 0.2)]


@pytest.mark.parametrize("vocab,seed", [(3000, 0), (49152, 1)])
def test_filtered_distribution_equals_the_full_sort_reference(vocab, seed):
    from ember_cupy.engine.sampler import filtered_distribution
    for row in _random_rows(vocab, seed):
        for top_k, top_p, min_p in FILTER_COMBOS:
            ids, probs = filtered_distribution(row, top_k, top_p, min_p)
            got = {int(t): float(q) for t, q in zip(ids, probs) if q > 0}
            assert got == _reference_filter(row, top_k, top_p, min_p), (top_k, top_p, min_p)
            if top_k or top_p < 1:   # sorted for the draw: by decreasing logit, lower id first
                assert list(zip(-row[ids], ids)) == sorted(zip(-row[ids], ids))


def test_the_batched_sampler_draws_the_reference_token():
    """Through Sampler (one partition for the batch, per-row kth): each seeded row's token is the
    inverse CDF of its own uniform over the reference distribution in sorted order."""
    vocab = 49152
    rows = _random_rows(vocab, 7)
    combos = [(40, 0.95, 0.0), (0, 0.95, 0.0), (0, 0.5, 0.05), (300, 1.0, 0.0), (5, 0.9, 0.05),
              (0, 0.999, 0.0), (2, 0.1, 0.0), (0, 1.0, 0.2)]
    seqs, logits, expected = [], [], []
    for n, (row, (top_k, top_p, min_p)) in enumerate(zip(rows, combos)):
        params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p, seed=100 + n)
        seqs.append(Sequence(f"s{n}", [0], params, 10))
        logits.append(row)
        ref = _reference_filter(row / np.float32(0.7), top_k, top_p, min_p)
        tokens = list(ref)
        if not (top_k or top_p < 1):
            tokens.sort()                     # no sort needed: the draw walks the ids in order
        cumulative = np.cumsum([ref[t] for t in tokens])
        u = np.random.default_rng([100 + n, 0]).random()
        expected.append(tokens[min(np.searchsorted(cumulative, u * cumulative[-1], side="right"), len(tokens) - 1)])
    assert Sampler(eos_token_ids=())(np.stack(logits), seqs).token_ids == expected


def test_a_seeded_row_draws_the_same_tokens_whatever_the_batch():
    rng = np.random.default_rng(3)
    mine = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=42)
    draws = []
    for batch in (1, 4, 9):
        logits = rng.standard_normal((batch, 5000)).astype(np.float32) * 2
        logits[batch // 2] = np.linspace(-3, 3, 5000, dtype=np.float32)
        seq = Sequence("mine", [1, 2], mine, 10)
        others = [Sequence(f"o{i}", [i], SamplingParams(temperature=1.0, top_p=0.5 + i / 20), 10)
                  for i in range(batch - 1)]
        seqs = others[:batch // 2] + [seq] + others[batch // 2:]
        sampler = Sampler(eos_token_ids=())
        draws.append([sampler(logits, seqs).token_ids[batch // 2] for _ in range(5)])
    assert draws[0] == draws[1] == draws[2]


# --- penalties for the whole batch equal the per-row definition -----------------------------
def _reference_process(row, seq, eos):
    """min_tokens, logit_bias, repetition, frequency and presence, one row at a time."""
    p = seq.params
    row = row.copy()
    if seq.num_output_tokens < p.min_tokens:
        row[list(p.stop_token_ids) + ([] if p.ignore_eos else eos)] = -np.inf
    for token, bias in (p.logit_bias or {}).items():
        row[token] += np.float32(bias)
    if p.repetition_penalty != 1.0:
        seen = np.unique(seq.token_ids)
        row[seen] = np.where(row[seen] > 0, row[seen] / p.repetition_penalty, row[seen] * p.repetition_penalty)
    if seq.output_token_ids:
        ids, counts = np.unique(seq.output_token_ids, return_counts=True)
        row[ids] -= p.frequency_penalty * counts + p.presence_penalty
    return row


def test_batched_penalties_equal_the_per_row_reference():
    rng = np.random.default_rng(11)
    vocab, eos = 700, [5, 6]
    seqs = []
    for i in range(12):
        params = SamplingParams(
            temperature=0.8, repetition_penalty=[1.0, 1.3, 0.7][i % 3], frequency_penalty=[0.0, 0.5, -0.3, 1.1][i % 4],
            presence_penalty=[0.0, 0.4, -1.0][i % 3], min_tokens=[0, 8][i % 2], stop_token_ids=[9] if i % 5 else [],
            logit_bias={int(t): float(rng.uniform(-100, 100)) for t in rng.choice(vocab, i % 4, replace=False)})
        seq = Sequence(f"s{i}", list(rng.integers(0, vocab, 1 + 7 * i)), params, 50)
        seq.token_ids += list(rng.integers(0, 40, 3 * i))     # repeats among the outputs
        seqs.append(seq)
    logits = (rng.standard_normal((len(seqs), vocab)) * 3).astype(np.float32)
    expected = np.stack([_reference_process(logits[i], seq, eos) for i, seq in enumerate(seqs)])
    processed = logits.copy()
    apply_logit_edits(processed, build_batch(seqs, vocab, list(eos), [0.0] * len(seqs)))
    assert np.array_equal(processed, expected)


def test_batched_top_k_draws_are_the_per_row_draws_bit_for_bit():
    """engine/batched_top_k.py against the per-row path it replaces (filtered_distribution, then
    the uniform inverted over the cumulative sum), on rows with and without ties at the k-th logit."""
    from ember_cupy.engine.batched_top_k import draw_top_k
    from ember_cupy.engine.sampler import filtered_distribution, kth_largest_numpy
    rows = np.stack(_random_rows(6000, 3) * 6)                                 # 48 rows
    rng = np.random.default_rng(11)
    combos = [(k, p) for k in (1, 5, 40, 300) for p in (1.0, 0.95, 0.5)]
    top_k = [combos[i % len(combos)][0] for i in range(len(rows))]
    top_p = [combos[i % len(combos)][1] for i in range(len(rows))]
    min_p = [0.2 if i % 11 == 0 else 0.0 for i in range(len(rows))]
    kth = list(kth_largest_numpy(rows, top_k))
    tops, uniforms = rows.max(axis=-1), rng.random(len(rows))
    batched = draw_top_k(rows, top_k, top_p, min_p, kth, tops, uniforms)
    assert 20 <= len(batched) < len(rows)           # tied and min_p rows are left to the per-row path
    for r, token in batched.items():
        ids, probs = filtered_distribution(rows[r], top_k[r], top_p[r], min_p[r], kth[r], tops[r])
        cumulative = np.cumsum(probs)
        pick = np.searchsorted(cumulative, uniforms[r] * cumulative[-1], side="right")
        assert token == ids[min(int(pick), len(ids) - 1)], r
