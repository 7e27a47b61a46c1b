"""The SchedulerStats an LLMEngine publishes (engine_client.py), on the real model: what the server's
admission control and /metrics read instead of the engine's parts."""
from ember_cupy import EngineConfig, SamplingParams
from ember_cupy.engine.llm_engine import LLMEngine


def test_the_engine_publishes_its_queues_and_cache_after_each_change(checkpoint):
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=32, max_num_seqs=1))
    assert (engine.stats.num_running, engine.stats.num_waiting, engine.stats.num_blocks) == (0, 0, 32)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("a", "The capital of France is", params)
    engine.add_request("b", "One, two, three,", params)
    assert (engine.stats.num_running, engine.stats.num_waiting) == (0, 2)
    during = []
    execute = engine.runner.execute

    def recording(batch):
        during.append(engine.stats)
        return execute(batch)
    engine.runner.execute = recording
    while engine.has_unfinished_requests():
        engine.step()
    first = during[0]
    assert (first.num_running, first.num_waiting, first.num_slots_used) == (1, 1, 1)   # max_num_seqs=1
    assert 0 < first.kv_cache_usage and first.num_free_blocks < 32
    assert first.prefix_cache_queries > 0
    done = engine.stats
    assert (done.num_running, done.num_waiting, done.kv_cache_usage, done.num_free_blocks) == (0, 0, 0.0, 32)
    assert done.spec_decode is None


def test_an_abort_is_published_at_once(checkpoint):
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=32))
    engine.add_request("a", "Hello", SamplingParams(max_tokens=50))
    engine.step()
    assert engine.stats.num_running == 1 and engine.stats.kv_cache_usage > 0
    engine.abort("a")
    assert (engine.stats.num_running, engine.stats.num_waiting, engine.stats.kv_cache_usage) == (0, 0, 0.0)
