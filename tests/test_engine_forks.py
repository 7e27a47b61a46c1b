"""n > 1 on the real model: forks count against max_num_seqs, a request's metrics cover all its
sequences, and recomputation after preemption is not a prefix-cache query."""
import pytest

from ember_cupy import EngineConfig, SamplingParams
from ember_cupy.engine.llm_engine import LLMEngine

PROMPT = "The capital of France is"


def _run(engine: LLMEngine, on_step=None) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        if on_step:
            on_step()
    return finals


def _count_preemptions(engine: LLMEngine) -> list:
    """Every preempted sequence, by wrapping the scheduler's preemption."""
    preempted, preempt = [], engine.scheduler._preempt

    def counting(seq, batch):
        preempted.append(seq)
        preempt(seq, batch)
    engine.scheduler._preempt = counting
    return preempted


def test_forked_sequences_count_against_max_num_seqs(checkpoint):
    engine = LLMEngine(checkpoint, EngineConfig(max_num_seqs=4))
    seen = []
    execute = engine.runner.execute

    def counting(batch):   # right after scheduling, as the engine published it
        seen.append(engine.stats.num_running)
        return execute(batch)
    engine.runner.execute = counting
    for i in range(2):
        engine.add_request(f"r{i}", PROMPT, SamplingParams(n=3, max_tokens=4, temperature=0.8, seed=i,
                                                                ignore_eos=True))
    finals = _run(engine, lambda: seen.append(engine.num_running))
    assert max(seen) <= 4          # was 6: the second request's forks bypassed the limit
    assert max(seen) == 3          # 3 + 3 cannot run together under 4: one request at a time
    for output in finals.values():
        assert sorted(c.index for c in output.outputs) == [0, 1, 2]
        assert all(len(c.token_ids) == 4 for c in output.outputs)


@pytest.fixture
def tiny_pool_engine(checkpoint):
    """Three sequences of ~24 tokens in a pool of 10 blocks of 4 tokens: they take turns."""
    return LLMEngine(checkpoint, EngineConfig(max_num_seqs=4, block_size=4, num_kv_blocks=10))


def test_metrics_of_an_n_request_cover_all_its_sequences(tiny_pool_engine):
    engine = tiny_pool_engine
    preempted = _count_preemptions(engine)
    engine.add_request("r", PROMPT, SamplingParams(n=3, max_tokens=18, temperature=0.8, seed=1, ignore_eos=True))
    output = _run(engine)["r"]
    assert len(preempted) > 0
    metrics = output.metrics
    assert metrics.num_preemptions == len(preempted)   # was seq 0's count only
    # seq 0 is never the victim (the newest fork is): its own count would be 0
    assert all(seq.index != 0 for seq in preempted)
    assert metrics.first_token_time <= metrics.last_token_time <= metrics.finished_time
    assert metrics.num_cached_tokens == output.num_cached_tokens == 0


def test_recomputation_after_preemption_is_not_a_prefix_cache_query(tiny_pool_engine):
    engine = tiny_pool_engine
    preempted = _count_preemptions(engine)
    engine.add_request("r", PROMPT, SamplingParams(n=3, max_tokens=18, temperature=0.8, seed=1, ignore_eos=True))
    _run(engine)
    assert len(preempted) > 0
    stats = engine.block_manager.prefix_stats
    prompt_len = len(engine.tokenizer.encode(PROMPT))
    assert stats.queries == prompt_len      # one query: the prompt, once (forks share it)
    assert stats.hits == 0
