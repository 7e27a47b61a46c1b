"""Issue 27's model-free parts: prompt lookup (vLLM's semantics), verification, the gate's choice
from step costs, the cost table, and the configuration's validation."""
from __future__ import annotations

import json
import random

import pytest

from ember_cupy.config import EngineConfig
from ember_cupy.engine.ngram_proposer import NgramIndex, NgramProposer
from ember_cupy.engine.spec_verify import accepted_count, verified_tokens
from ember_cupy.engine.speculation_gate import Candidate, choose_drafts
from ember_cupy.engine.step_costs import StepCosts
from ember_cupy.speculative_config import SpeculativeConfig


def test_prompt_lookup_takes_the_longest_suffix_match_and_its_earliest_occurrence():
    assert NgramIndex(2, 3).propose([1, 2, 3, 4, 2, 3], 4) == [4, 2, 3]   # vLLM's docstring example
    # [5, 6, 7] matches at 0 (3-gram) and [6, 7] also at 4: the longest wins
    assert NgramIndex(2, 3).propose([5, 6, 7, 8, 6, 7, 9, 5, 6, 7], 2) == [8, 6]
    # the 2-gram [1, 2] occurs at 0 and 3: the earliest
    assert NgramIndex(2, 2).propose([1, 2, 7, 1, 2, 8, 1, 2], 3) == [7, 1, 2]
    assert NgramIndex(2, 4).propose([1, 2, 3, 4], 4) == []                   # no earlier occurrence
    assert NgramIndex(2, 4).propose([1, 2, 1, 2], 0) == []                   # no room
    assert NgramIndex(3, 3).propose([1, 2], 4) == []                         # shorter than the n-gram
    assert NgramIndex(1, 1).propose([9, 9, 9], 5) == [9, 9]                  # overlapping match, up to the end



def scanned_drafts(token_ids: list[int], max_tokens: int, min_n: int, max_n: int) -> list[int]:
    """prompt lookup by a scan of the whole list: the test's own oracle"""
    total = len(token_ids)
    if max_tokens <= 0 or total <= min_n:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        for start in range(total - n):
            if token_ids[start:start + n] == token_ids[total - n:]:
                return token_ids[start + n:start + n + max_tokens]
    return []


class TokenList:
    """what the proposer reads of a sequence"""
    token_ids: list[int]


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (2, 4), (3, 5)])
def test_a_sequences_index_follows_its_growing_and_cut_token_list(min_n, max_n):
    """One proposer asked at every length of a list that grows by 1-4 tokens a step (a
    verification's accepted run) and is cut now and then (a stop string): each answer equals a
    scan of the whole list, so the index never misses or keeps a stale occurrence."""
    rng = random.Random(min_n * 10 + max_n)
    proposer = NgramProposer(min_n, max_n)
    seq = TokenList()
    seq.token_ids = [rng.randrange(6) for _ in range(5)]
    asked = 0
    for step in range(400):
        if step % 97 == 96:
            del seq.token_ids[len(seq.token_ids) - rng.randrange(1, 6):]
        limit = rng.randrange(0, 5)
        assert proposer.propose_batch([seq], [limit]) == [scanned_drafts(seq.token_ids, limit, min_n, max_n)]
        asked += bool(limit)
        seq.token_ids += [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
    assert asked > 300
    proposer.release(seq)
    assert not proposer._indexes

def test_verification_keeps_the_agreeing_prefix_and_the_targets_next_token():
    assert accepted_count([4, 5, 6], [4, 5, 7, 8]) == 2
    assert verified_tokens([4, 5, 6], [4, 5, 7, 8]) == [4, 5, 7]      # correction at the rejection
    assert verified_tokens([4, 5, 6], [4, 5, 6, 8]) == [4, 5, 6, 8]   # all kept: the bonus token
    assert verified_tokens([4, 5, 6], [1, 5, 6, 8]) == [1]


def test_the_gate_follows_costs_and_acceptance():
    free = lambda n: 1.0                     # noqa: E731
    linear = lambda n: float(n)              # noqa: E731
    knee = lambda n: 1.0 if n <= 8 else n / 8.0   # rows free up to 8, then each costs its share  # noqa: E731
    good, poor = Candidate(4, 0.9), Candidate(4, 0.05)
    assert choose_drafts([good], 1, free) == [4]
    assert choose_drafts([good], 1, linear) == [0]
    assert choose_drafts([Candidate(4, 0.0)], 1, free) == [0]          # worthless drafts cost nothing, gain nothing
    # one decode alone: the good sequence drafts up to the knee; 16 decodes: no room under the knee
    assert choose_drafts([good, poor], 2, knee) == [4, 2]
    assert choose_drafts([good] * 16, 16, knee) == [0] * 16
    # rows cost a little: the good sequence drafts, the poor one does not
    cheap = lambda n: 1.0 + 0.05 * n         # noqa: E731
    assert choose_drafts([good, poor], 2, cheap) == [4, 0]


def test_the_gate_charges_a_draft_models_steps_per_drafted_position():
    free = lambda n: 1.0                     # noqa: E731
    good = Candidate(4, 0.9)
    assert choose_drafts([good], 1, free, lambda m: 0.0) == [4]
    # a draft step costs a tenth of a target step: the fourth draft (worth 0.9**4) still pays
    assert choose_drafts([good], 1, free, lambda m: 0.1) == [4]
    # half a target step: the fourth position's 0.66 tokens no longer pay for it
    assert choose_drafts([good], 1, free, lambda m: 0.5) == [3]
    assert choose_drafts([good], 1, free, lambda m: 2.0) == [0]
    # one draft step drafts a position for every sequence: four sequences pay it once per position
    assert choose_drafts([good] * 4, 4, free, lambda m: 0.5) == [3] * 4
    # while a draft model whose step grows with its rows costs each sequence its share
    assert choose_drafts([good] * 4, 4, free, lambda m: 0.5 * m) == [0] * 4



def test_the_gate_charges_the_rows_a_draft_model_must_catch_up_before_it_drafts():
    """The first draft step also computes the tokens the draft lacks: a sequence 6 tokens behind
    costs 6 rows there, not 1 (a 16-stream server drafted at a loss when it was charged 1)."""
    free = lambda n: 1.0                     # noqa: E731
    per_row = lambda m: 0.1 * m              # noqa: E731
    assert choose_drafts([Candidate(4, 0.9)], 1, free, per_row) == [4]
    # 6 rows behind: 0.6 s more for the first position, still repaid by four drafts
    assert choose_drafts([Candidate(4, 0.9, first_rows=6)], 1, free, per_row) == [4]
    assert choose_drafts([Candidate(4, 0.9, first_rows=40)], 1, free, per_row) == [0]
    behind = [Candidate(2, 0.9, first_rows=3)] * 2
    # position 0 costs the two sequences' 6 rows, position 1 their 2: (2 + 2 * (0.9 + 0.81)) / (1 + 0.8)
    # beats 2 / 1; at 0.3 s a row it does not (with 1 row behind each, it would)
    assert choose_drafts(behind, 2, free, per_row) == [2, 2]
    assert choose_drafts(behind, 2, free, lambda m: 0.3 * m) == [0, 0]
    assert choose_drafts([Candidate(2, 0.9)] * 2, 2, free, lambda m: 0.3 * m) == [2, 2]


def test_step_costs_interpolate_between_measured_sizes_and_follow_new_measurements():
    costs = StepCosts()
    assert not costs.measured
    costs.calibrate(lambda n: 0.01 + 0.001 * n, 16)
    assert costs.measured
    assert costs.seconds(4) == pytest.approx(0.014)
    assert costs.seconds(6) == pytest.approx(0.016)     # between 4 and 8
    assert costs.seconds(32) == pytest.approx(0.042)    # past 16: along the last two
    for _ in range(50):
        costs.record(4, 0.1)
    assert costs.seconds(4) == pytest.approx(0.1, rel=1e-3)



def test_sizes_not_measured_again_follow_the_load_of_those_that_are():
    """A server measures only the sizes it keeps running (4 decodes): when those run slower than
    at start-up, the sizes a draft would take them to (8) must slow down alike, or the drafts look
    cheap (the numbers of a 4-stream server with a draft model that drafted at a loss)."""
    start_up = {1: 0.0056, 2: 0.0062, 4: 0.0095, 8: 0.0161, 16: 0.0238}
    costs = StepCosts()
    costs.calibrate(lambda n: start_up.get(n, 0.0238 * n / 16), 16)
    for _ in range(30):
        costs.record(4, 0.0138)
    assert costs.seconds(4) == pytest.approx(0.0138, rel=5e-3)
    assert costs.seconds(8) == pytest.approx(0.0161 * 0.0138 / 0.0095, rel=5e-3)
    assert costs.seconds(6) == pytest.approx((costs.seconds(4) + costs.seconds(8)) / 2)
    draft_step = lambda m: 0.0102 * m / 4   # noqa: E731  (a draft model as costly as the target)
    sure = Candidate(1, 0.95)
    assert choose_drafts([sure] * 4, 4, costs.seconds, draft_step) == [0] * 4
    for _ in range(30):     # the load goes: every size is back to its start-up time
        costs.record(4, 0.0095)
    assert costs.seconds(8) == pytest.approx(0.0161, rel=5e-3)


def test_a_draft_models_table_follows_the_targets_load():
    """The draft runs only when the gate drafts: its own steps seldom tell it that the machine got
    slower, and a quiet draft beside a loaded target looks cheap. It shares the target's level."""
    target = StepCosts()
    target.calibrate(lambda n: 0.006 * n, 8)
    draft = StepCosts(target.level)
    draft.calibrate(lambda n: 0.003 * n, 8)
    for _ in range(30):
        target.record(1, 0.009)
    assert draft.seconds(1) == pytest.approx(0.0045, rel=5e-3)
    assert draft.seconds(4) == pytest.approx(0.018, rel=5e-3)

def test_speculative_config_takes_vllm_keys_and_refuses_bad_ones():
    cfg = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig(num_speculative_tokens=2).prompt_lookup_min == 5
    assert SpeculativeConfig(num_speculative_tokens=2, model="draft.gguf").method == "draft_model"
    engine = EngineConfig(speculative_config={"num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert engine.speculative_config == SpeculativeConfig(2, "ngram", 2, 2)
    bad = [{"num_speculative_tokens": 0}, {"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
           {"num_speculative_tokens": 2, "method": "eagle"}, {"num_speculative_tokens": 2, "typo": 1},
           {"method": "ngram"}, {"num_speculative_tokens": 2, "method": "draft_model"},
           {"num_speculative_tokens": True}, "[1]", "{not json"]
    for value in bad:
        with pytest.raises(ValueError, match="speculative_config"):
            EngineConfig(speculative_config=value if isinstance(value, str) else json.dumps(value))
