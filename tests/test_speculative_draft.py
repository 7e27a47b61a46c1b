"""Issue 27: speculative decoding with a draft model, through LLM on the real model. The default
model drafting for itself is accepted nearly always; a tiny random draft of the same vocabulary
almost never; either way the output is the plain output token for token (greedy and seeded), and
the draft model's KV pages are given back when sequences end, are aborted or preempted."""
from __future__ import annotations

import pytest
from step_cost_stand_ins import FreeDrafting, FreeVerification
from tiny_draft import write_tiny_draft
from tiny_model import write_tiny_checkpoint

from ember_cupy import LLM, SamplingParams
from ember_cupy.model.loader import default_model_path

PROMPTS = ["The capital of France is", "Write a short story about a lighthouse keeper.",
           "List three colours: red,"]
CATCH_UP_BUDGET = 5


class CostlyDrafting(FreeVerification):
    """Each draft-model step costs ten target steps: no draft can pay."""

    def seconds(self, num_tokens):
        return 10.0


def _always_drafting(llm: LLM) -> LLM:
    llm.engine.speculator.costs = FreeVerification()
    llm.engine.speculator.proposer.costs = FreeDrafting()
    return llm


def _draft_config(path: str, k: int = 4) -> dict:
    return {"model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def plain(checkpoint):
    return LLM(checkpoint)


@pytest.fixture(scope="module")
def self_drafting(checkpoint):
    llm = _always_drafting(LLM(checkpoint, speculative_config=_draft_config(default_model_path())))
    # the draft catches up with each prompt in chunks of 5 tokens, over several steps: its
    # acceptance shows that the chunks leave its cache as one pass would
    llm.engine.speculator.proposer.catch_up_budget = CATCH_UP_BUDGET
    return llm


@pytest.fixture(scope="module")
def tiny_draft_path(tmp_path_factory, checkpoint):
    return write_tiny_draft(tmp_path_factory.mktemp("draft"), checkpoint.config.vocab_size)


@pytest.fixture(scope="module")
def tiny_drafting(checkpoint, tiny_draft_path):
    return _always_drafting(LLM(checkpoint, speculative_config=_draft_config(tiny_draft_path, 3)))


def _same_tokens(left, right):
    for a, b in zip(left, right, strict=True):
        assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in a.outputs] == \
               [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in b.outputs]


def _counts(llm) -> tuple[int, int]:
    stats = llm.engine.spec_decode_stats
    return stats.num_draft_tokens, stats.num_accepted_tokens


def _acceptance(llm, before) -> float:
    drafted, accepted = (now - then for now, then in zip(_counts(llm), before))
    assert drafted > 0
    return accepted / drafted


def _draft_pages_all_free(llm) -> bool:
    proposer = llm.engine.speculator.proposer
    manager = proposer.block_manager
    return not proposer._shadows and manager.num_free_blocks == manager.num_blocks


def test_the_model_drafting_for_itself_is_accepted_and_changes_nothing(plain, self_drafting):
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    before = _counts(self_drafting)
    _same_tokens(plain.generate(PROMPTS, greedy), self_drafting.generate(PROMPTS, greedy))
    assert _acceptance(self_drafting, before) >= 0.95
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, n=2, max_tokens=24)
    before = _counts(self_drafting)
    _same_tokens(plain.generate(PROMPTS, seeded), self_drafting.generate(PROMPTS, seeded))
    assert _acceptance(self_drafting, before) > 0   # a greedy draft of a sampled text: some
    assert _draft_pages_all_free(self_drafting)


def test_a_tiny_random_draft_is_rarely_accepted_and_changes_nothing(plain, tiny_drafting):
    params = [SamplingParams(temperature=0, max_tokens=7),
              SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=24, stop=[" the"]),
              SamplingParams(temperature=0, max_tokens=40, stop=["\n"], include_stop_str_in_output=True)]
    before = _counts(tiny_drafting)
    outputs = tiny_drafting.generate(PROMPTS, params)
    _same_tokens(plain.generate(PROMPTS, params), outputs)
    assert len(outputs[0].outputs[0].token_ids) <= 7
    assert _acceptance(tiny_drafting, before) < 0.2
    assert _draft_pages_all_free(tiny_drafting)


def test_draft_pages_follow_the_sequences_and_an_abort_frees_them(checkpoint, tiny_draft_path):
    """Stepped by hand under a small target pool (preemption) and a small step (decodes left out),
    prompts caught up in chunks: the draft model caches only running sequences, at most their
    tokens; an abort and the end free every draft page."""
    llm = LLM(checkpoint, speculative_config=_draft_config(tiny_draft_path, 3),
              block_size=4, num_kv_blocks=20, max_num_seqs=4, max_num_batched_tokens=6)
    engine, proposer = llm.engine, llm.engine.speculator.proposer
    assert proposer.costs.measured and proposer.costs.seconds(1) > 0   # the draft's steps timed at start-up
    assert proposer.costs.level is engine.speculator.costs.level      # one machine, one load level
    _always_drafting(llm)
    execute = proposer.runner.execute

    def every_row_computes(batch):   # a shadow left fully computed (its decode was not scheduled) runs again
        assert all(num_tokens > 0 for _, num_tokens in batch.scheduled)
        return execute(batch)
    proposer.runner.execute = every_row_computes
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS + [PROMPTS[1] + " Make it sad."]):
        engine.add_request(f"r{i}", prompt, params)
    proposer.catch_up_budget = CATCH_UP_BUDGET
    cached, preempted, chunked = 0, 0, False
    while engine.has_unfinished_requests():
        engine.step()
        running = {id(seq): seq for seq in engine.scheduler.running}
        assert set(proposer._shadows) <= set(running)
        for key, shadow in proposer._shadows.items():
            assert shadow.token_ids == running[key].token_ids[:shadow.num_tokens]
            assert shadow.num_computed_tokens <= running[key].num_tokens
            chunked |= 0 < shadow.num_computed_tokens < shadow.num_tokens - 1   # a prompt caught up in part
        cached = max(cached, len(proposer._shadows))
        everyone = engine.scheduler.running + engine.scheduler.waiting
        preempted = max(preempted, sum(seq.stats.num_preemptions for seq in everyone))
    assert cached > 1 and preempted > 0 and chunked and _draft_pages_all_free(llm)
    engine.add_request("aborted", PROMPTS[1], params)
    for _ in range(3):
        engine.step()
    assert proposer._shadows
    engine.abort("aborted")
    assert _draft_pages_all_free(llm)


def test_the_gate_weighs_the_draft_models_measured_cost(tiny_drafting, monkeypatch):
    proposer, calls = tiny_drafting.engine.speculator.proposer, []
    propose_batch = proposer.propose_batch
    monkeypatch.setattr(proposer, "propose_batch", lambda *args: calls.append(1) or propose_batch(*args))
    monkeypatch.setattr(proposer, "costs", CostlyDrafting())
    drafts = tiny_drafting.engine.spec_decode_stats.num_drafts
    tiny_drafting.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8))
    assert tiny_drafting.engine.spec_decode_stats.num_drafts == drafts
    assert not calls   # no draft could pay: the draft model never ran



def test_the_gate_is_told_the_rows_the_draft_model_must_catch_up(checkpoint, tiny_draft_path):
    """first_rows(seq), which the gate charges, is what the draft's first step then computes for
    seq: 1 as a sequence starts, its lag after steps that did not draft."""
    llm = _always_drafting(LLM(checkpoint, speculative_config=_draft_config(tiny_draft_path, 3)))
    engine, proposer = llm.engine, llm.engine.speculator.proposer
    engine.add_request("r", PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()                                   # the prompt
    seq = engine.scheduler.running[0]
    assert proposer.first_rows(seq) == 1            # not seen yet: its prompt's catch-up is not charged
    firsts, execute = [], proposer.runner.execute
    proposer.runner.execute = lambda batch: firsts.append(dict(batch.scheduled).popitem()[1]) or execute(batch)
    lags = []
    for drafting in (True, False, False, False, True, True):
        proposer.costs = FreeDrafting() if drafting else CostlyDrafting()
        expected, tokens, firsts[:] = proposer.first_rows(seq), seq.num_tokens, []
        engine.step()
        if not drafting:
            assert not firsts
        elif lags or expected != 1:
            assert firsts[0] == expected
            lags.append(expected)
        else:                                       # the first: the whole prompt, uncharged
            assert firsts[0] == tokens
            lags.append(0)
    assert max(lags) >= 4   # three steps without drafts: three more tokens to catch up

def test_a_draft_of_another_vocabulary_is_refused(checkpoint, tmp_path):
    write_tiny_checkpoint(tmp_path / "small")
    with pytest.raises(ValueError, match=r"vocabulary has 64 tokens, the target model's 49152"):
        LLM(checkpoint, speculative_config=_draft_config(str(tmp_path / "small")))
    renamed = write_tiny_draft(tmp_path, checkpoint.config.vocab_size, renamed_tokens={3: "<not-smollm>"})
    with pytest.raises(ValueError, match=r"tokenizer differs .*token id 3 is '<not-smollm>'"):
        LLM(checkpoint, speculative_config=_draft_config(renamed))
