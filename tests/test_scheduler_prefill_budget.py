"""max_num_prefill_tokens (issue 24): a step computes at most that many prompt tokens, so a huge
request's steps stay short (a request arriving meanwhile waits for one of them); decodes are not
held back and a short prompt still starts whole at the next step. No model: engine/trace_replay.py."""
import pytest

from ember_cupy.config import EngineConfig
from ember_cupy.engine.trace_replay import TraceReplay, TraceRequest

PREFILL_BUDGET = 32


def tokens_of(batch, prefix: str) -> dict[str, int]:
    return {seq.request_id: n for seq, n in batch.scheduled if seq.request_id.startswith(prefix)}


def bulk_run(max_num_prefill_tokens) -> TraceReplay:
    """3 chats decoding, then 32 prompts of 100 tokens (one client request's inputs) arrive."""
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=1024, block_size=4,
                          max_num_prefill_tokens=max_num_prefill_tokens)
    run = TraceReplay(config, 1000)
    for i in range(3):
        run.add(TraceRequest(f"chat{i}", 0, 5, 200))
    run.step()                                          # the chats' prompts
    for i in range(32):
        run.add(TraceRequest(f"bulk{i}", 1, 100, 1))
    return run


def test_a_step_computes_at_most_max_num_prefill_tokens_prompt_tokens():
    run = bulk_run(PREFILL_BUDGET)
    steps = 0
    while any(seq.request_id.startswith("bulk") for seq in run.live_sequences) or steps == 0:
        batch = run.step()
        steps += 1
        assert sum(tokens_of(batch, "bulk").values()) <= PREFILL_BUDGET
        assert tokens_of(batch, "chat") == {"chat0": 1, "chat1": 1, "chat2": 1}   # decodes every step
    assert steps == -(-3200 // PREFILL_BUDGET)            # and the budget is used whole


def test_without_a_prefill_budget_the_bulk_fills_the_step():
    """The contrast: max_num_prefill_tokens=None leaves only max_num_batched_tokens."""
    batch = bulk_run(None).step()
    assert sum(tokens_of(batch, "bulk").values()) == 1024 - 3


@pytest.mark.parametrize("prompt_len", [20, PREFILL_BUDGET])
def test_a_short_prompt_arriving_during_the_bulk_starts_whole_at_the_next_step(prompt_len):
    run = bulk_run(PREFILL_BUDGET)
    for _ in range(3):
        run.step()
    run.add(TraceRequest("late", run.scheduler.step_count, prompt_len, 1))
    batch = run.step()
    assert tokens_of(batch, "late") == {"late": prompt_len}
    assert prompt_len + sum(tokens_of(batch, "bulk").values()) <= PREFILL_BUDGET
    assert run.timelines["late"].finished_step == run.scheduler.step_count


def test_a_lone_prompt_takes_whole_steps_until_another_request_arrives():
    """The budget holds while the step is shared: a 3,000-token prompt alone runs in steps of
    max_num_batched_tokens (it keeps no one waiting); once a chat arrives, the steps are short."""
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=1024, block_size=4,
                          max_num_prefill_tokens=PREFILL_BUDGET)
    run = TraceReplay(config, 2000)
    run.add(TraceRequest("lone", 0, 3000, 1))
    assert tokens_of(run.step(), "lone") == {"lone": 1024}
    run.add(TraceRequest("chat", run.scheduler.step_count, 20, 5))
    batch = run.step()
    assert tokens_of(batch, "chat") == {"chat": 20}
    assert tokens_of(batch, "lone") == {"lone": PREFILL_BUDGET - 20}
