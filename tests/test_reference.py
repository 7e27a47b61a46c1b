"""The real model against an independent implementation (HF transformers, fp32, see
tools/make_reference.py): prompt logits at several positions and 32 greedy tokens."""
import json
import os

import numpy as np
import pytest

from ember_cupy import SamplingParams

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "reference_logits.json")
REFERENCE = json.load(open(FIXTURE))
PROMPTS = {p["name"]: p for p in REFERENCE["prompts"]}
TOP = 10


@pytest.fixture(scope="module")
def llm(checkpoint):
    from ember_cupy import LLM
    # quantization="none": the exact fp32 mode (the quantized default is held to the reference by
    # tests/test_quantized_fidelity.py); the ~500-token prompt runs in chunks
    return LLM(checkpoint, max_num_batched_tokens=256, quantization="none")


@pytest.fixture(scope="module")
def results(llm):
    """All prompts in one batch: greedy tokens, prompt logprobs and first-step logprobs."""
    names = sorted(PROMPTS)
    params = SamplingParams(temperature=0, max_tokens=REFERENCE["n_greedy"], ignore_eos=True,
                            logprobs=TOP, prompt_logprobs=TOP)
    outputs = llm.generate([PROMPTS[n]["input_ids"] for n in names], params)
    return dict(zip(names, outputs))


def test_fixture_covers_the_issue_cases():
    lengths = [p["n_tokens"] for p in PROMPTS.values()]
    assert len(PROMPTS) >= 8 and min(lengths) == 1 and max(lengths) >= 450


def test_tokenizer_gives_the_reference_ids(tokenizer):
    for prompt in PROMPTS.values():
        assert tokenizer.encode(prompt["text"]) == prompt["input_ids"], prompt["name"]


def _logprob_rows(output, prompt):
    """Our top-k (id, logprob) at each reference position: prompt logprobs for p < n-1,
    the first sampled step at p = n-1."""
    n = len(prompt["input_ids"])
    rows = {}
    for entry in prompt["positions"]:
        p = entry["pos"]
        rows[p] = output.outputs[0].logprobs[0] if p == n - 1 else output.prompt_logprobs[p + 1]
    return rows


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_logits_match_within_1e3(results, name):
    prompt = PROMPTS[name]
    for entry in prompt["positions"]:
        ours = dict(_logprob_rows(results[name], prompt)[entry["pos"]].top)
        ref_ids, ref_logits = entry["top_ids"], np.array(entry["top_logits"], dtype=np.float64)
        assert list(ours)[:3] == ref_ids[:3], (name, entry["pos"])  # same leaders (beyond: ties)
        common = [i for i in ref_ids if i in ours]
        assert len(common) >= TOP - 1, (name, entry["pos"])
        # logprobs and logits differ by one per-row constant: compare differences to the top token
        ref = {i: v for i, v in zip(ref_ids, ref_logits)}
        ours_gap = np.array([ours[i] - ours[ref_ids[0]] for i in common])
        ref_gap = np.array([ref[i] - ref[ref_ids[0]] for i in common])
        assert np.abs(ours_gap - ref_gap).max() < 1e-3, (name, entry["pos"])


NEAR_TIE = 2e-3  # above the fp32 noise (~1e-4) yet a tie in practice: either token is right


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_continuation_is_identical(results, name):
    """Identical up to the first near-tie of the reference (and in practice all 32 tokens)."""
    gaps = PROMPTS[name]["greedy_gaps"]
    checked = next((i + 1 for i, gap in enumerate(gaps) if gap < NEAR_TIE), len(gaps))
    assert checked >= 4
    assert results[name].outputs[0].token_ids[:checked] == PROMPTS[name]["greedy"][:checked]
