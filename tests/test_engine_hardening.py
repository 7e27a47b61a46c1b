"""Engine-level limits and policies of issue 11, through the public Python API."""
import pytest

from ember_cupy import EngineConfig, SamplingParams
from ember_cupy.engine.llm_engine import LLMEngine


def test_sjf_ranks_requests_without_max_tokens_by_prompt_length(checkpoint):
    """The chat default (max_tokens=None) resolves to "the rest of the context" for every request;
    sjf must still serve the shortest prompt first instead of falling back to arrival order."""
    engine = LLMEngine(checkpoint, EngineConfig(policy="sjf", max_num_seqs=1, num_kv_blocks=64,
                                                max_model_len=256))
    params = SamplingParams(max_tokens=None, temperature=0)
    prompts = {"long": "word " * 60, "medium": "word " * 20, "short": "word"}
    for request_id, prompt in prompts.items():           # the longest arrives first
        engine.add_request(request_id, prompt, params)
    order = []
    while len(order) < len(prompts):
        for output in engine.step():
            if output.request_id not in order:
                order.append(output.request_id)
                engine.abort(output.request_id)             # one step each is enough to see the order
    assert order == ["short", "medium", "long"]


def test_sjf_uses_max_tokens_when_given_to_break_prompt_ties(checkpoint):
    engine = LLMEngine(checkpoint, EngineConfig(policy="sjf", max_num_seqs=1, num_kv_blocks=64,
                                                max_model_len=256))
    engine.add_request("unbounded", "same prompt here", SamplingParams(max_tokens=None))
    engine.add_request("many", "same prompt here", SamplingParams(max_tokens=100))
    engine.add_request("few", "same prompt here", SamplingParams(max_tokens=3))
    order = []
    while len(order) < 3:
        for output in engine.step():
            if output.request_id not in order:
                order.append(output.request_id)
                engine.abort(output.request_id)
    assert order == ["few", "many", "unbounded"]


def test_stop_strings_are_bounded_in_count_and_length():
    from ember_cupy.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS
    assert (MAX_STOP_STRINGS, MAX_STOP_LENGTH) == (16, 1024)
    SamplingParams(stop=["x" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS)     # the limits themselves are fine
    with pytest.raises(ValueError, match=r"stop.*1024"):
        SamplingParams(stop="x" * 100_000)
    with pytest.raises(ValueError, match=r"stop.*1024"):
        SamplingParams(stop=["ok", "y" * (MAX_STOP_LENGTH + 1)])
    with pytest.raises(ValueError, match=r"stop.*16"):
        SamplingParams(stop=[str(i) for i in range(MAX_STOP_STRINGS + 1)])


def test_prefix_cache_keys_are_sha256_digests_of_the_chain(make_llm):
    from ember_cupy.engine.block_manager import BlockManager
    bm = BlockManager(num_blocks=4, block_size=4)
    root = bm.hash_block(None, [1, 2, 3, 4], None)
    assert isinstance(root, bytes) and len(root) == 32            # a SHA-256 digest, not hash()
    assert bm.hash_block(None, (1, 2, 3, 4), None) == root          # list or tuple: same key
    others = [bm.hash_block(None, [1, 2, 3, 5], None),              # other tokens
              bm.hash_block(None, [4, 3, 2, 1], None),
              bm.hash_block(None, [1, 2, 3, 4], "tenant-a"),        # other salt
              bm.hash_block(root, [1, 2, 3, 4], None),              # other parent
              bm.hash_block(None, [1 << 20, 2, 3, 4], None)]
    assert len({root, *others}) == 1 + len(others)
    # through the engine: every cached block is keyed by a 32-byte digest, and hits still happen
    llm = make_llm(block_size=4, num_kv_blocks=64)
    prompt = "The quick brown fox jumps over the lazy dog, " * 3
    params = SamplingParams(temperature=0, max_tokens=2)
    first, second = llm.generate([prompt], params)[0], llm.generate([prompt], params)[0]
    cached = llm.engine.block_manager.cached
    assert cached and all(isinstance(k, bytes) and len(k) == 32 for k in cached)
    assert second.num_cached_tokens > 0 and second.outputs[0].token_ids == first.outputs[0].token_ids


def test_float16_is_refused_on_the_numpy_backend(checkpoint, capsys):
    from ember_cupy import LLM, cli
    with pytest.raises(ValueError, match="float16.*BLAS"):
        LLM(checkpoint, dtype="float16", num_kv_blocks=16)
    # the server refuses it before it opens its socket or loads the model
    assert cli.main(["serve", "--dtype", "float16", "--port", "1"]) == 2
    assert "float16" in capsys.readouterr().err


def test_a_lone_surrogate_in_a_prompt_is_a_value_error(make_llm):
    llm = make_llm(num_kv_blocks=16)
    with pytest.raises(ValueError, match="surrogate"):
        llm.generate("a\ud800b", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="surrogate"):
        llm.chat([{"role": "user", "content": "x\udfffy"}], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="surrogate"):
        llm.tokenizer.encode("\ud83d")
    assert llm.tokenizer.encode("\U0001F600") == llm.tokenizer.encode("\ud83d\ude00".encode(
        "utf-16", "surrogatepass").decode("utf-16"))              # a proper pair is just a character
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 1e-300), ("repetition_penalty", 0.001), ("repetition_penalty", 1000.0),
    ("repetition_penalty", float("nan")), ("temperature", float("inf")), ("temperature", 101.0),
    ("presence_penalty", float("nan")), ("frequency_penalty", 2.5), ("top_p", float("nan")),
    ("min_p", float("nan")), ("logit_bias", {"5": float("nan")}), ("logit_bias", {"5": -101}),
])
def test_sampling_params_refuse_values_that_could_make_nan(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_extreme_accepted_sampling_values_give_finite_results(make_llm):
    from ember_cupy.sampling_params import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
    llm = make_llm(num_kv_blocks=32)
    vocab = llm.engine.model_config.vocab_size
    for penalty in (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY):
        params = SamplingParams(repetition_penalty=penalty, temperature=1e-5, presence_penalty=-2,
                                frequency_penalty=-2, logit_bias={5: 100, 6: -100}, max_tokens=4,
                                ignore_eos=True, logprobs=2, seed=1)
        completion = llm.generate("The capital of France is", params)[0].outputs[0]
        assert len(completion.token_ids) == 4 and all(0 <= t < vocab for t in completion.token_ids)
        import math
        assert all(math.isfinite(lp.logprob) or lp.logprob == -math.inf for lp in completion.logprobs)


def test_a_kv_cache_too_small_for_a_minimal_context_is_refused(checkpoint):
    from ember_cupy.engine.llm_engine import MIN_KV_CONTEXT
    assert MIN_KV_CONTEXT == 256
    probe = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=1))    # an explicit pool is taken as asked
    block = sum(k.nbytes + v.nbytes for k, v in probe.runner.kv_caches)  # bytes of one 16-token block
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLMEngine(checkpoint, EngineConfig(kv_cache_memory=1))                 # was: a 16-token context
    with pytest.raises(ValueError, match="256 tokens"):
        LLMEngine(checkpoint, EngineConfig(kv_cache_memory=15 * block))
    engine = LLMEngine(checkpoint, EngineConfig(kv_cache_memory=16 * block))   # 256 tokens: enough
    assert engine.max_model_len == 256
    # a context asked to be shorter than the minimum only needs that much
    assert LLMEngine(checkpoint, EngineConfig(kv_cache_memory=4 * block, max_model_len=64)).max_model_len == 64


def test_a_kv_cache_larger_than_the_machine_is_refused_at_start(checkpoint):
    """The host pool is a lazy mapping: more than the machine has used to be granted at start
    (30 GiB on a 24 GB machine served until the OOM killer came) or failed as a bare ENOMEM."""
    from ember_cupy.host_memory import memory_limit
    limit = memory_limit()
    assert limit is not None and limit > 1 << 28          # Linux says: sysconf, cgroup
    for asked in (limit + (1 << 30), 99 << 40):
        with pytest.raises(ValueError, match=r"kv_cache_memory \(--kv-cache-memory\) asks for .* GiB"):
            LLMEngine(checkpoint, EngineConfig(kv_cache_memory=asked))
    block = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=1)).runner.block_bytes
    with pytest.raises(ValueError, match="num_kv_blocks="):
        LLMEngine(checkpoint, EngineConfig(num_kv_blocks=limit // block + 1))
