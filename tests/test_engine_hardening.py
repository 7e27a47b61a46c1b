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
