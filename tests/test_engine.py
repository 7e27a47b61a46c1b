"""The engine on the real model: continuous batching, block accounting, the Python API."""
import pytest

from ember_cupy import EngineConfig, LLM, SamplingParams
from ember_cupy.engine.llm_engine import LLMEngine

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
    "1, 2, 3, 4,", "Translate to French: good morning", "The quick brown fox",
    "import numpy as np\n", "Q: What is the boiling point of water?\nA:", "Hello", "Why is the sky blue?",
    "Write a haiku about the sea.", "SELECT * FROM users WHERE", "The mitochondria is",
    "In 1969, astronauts", "List three colors:", "Tiếng Việt là",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _all_blocks_free(engine: LLMEngine) -> bool:
    bm = engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def _run_staggered(engine: LLMEngine, prompts, params, arrivals):
    """Add prompt i at step arrivals[i]; run to completion; token ids by request."""
    done, step = {}, 0
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
        step += 1
    return [done[i] for i in range(len(prompts))]


def test_batch_invariance_with_staggered_arrivals(make_llm):
    llm = make_llm(max_num_batched_tokens=48, max_num_seqs=16)
    alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    arrivals = [(i * 3) % 7 for i in range(len(PROMPTS))]
    batched = _run_staggered(llm.engine, PROMPTS, GREEDY, arrivals)
    assert batched == alone
    assert _all_blocks_free(llm.engine)


def test_outputs_have_text_tokens_and_finish_reason(make_llm):
    llm = make_llm()
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=5))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5
    assert completion.text == llm.tokenizer.decode(completion.token_ids)
    assert "Paris" in completion.text


def test_chat_stops_on_end_of_turn(make_llm):
    llm = make_llm()
    out = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=64))
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert completion.token_ids[-1] in llm.engine.model_config.eos_token_ids
    assert "<|im_end|>" not in completion.text and completion.text.strip()


def test_stop_strings_and_stop_token_ids(make_llm):
    llm = make_llm()
    base = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert " 7" in base.text
    stopped = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop=[" 7"]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 7"
    assert stopped.text == base.text[:base.text.index(" 7")]
    token = base.token_ids[3]
    by_id = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20,
                                                       stop_token_ids=[token]))[0].outputs[0]
    assert by_id.stop_reason == token and by_id.token_ids == base.token_ids[:base.token_ids.index(token) + 1]


def test_seed_gives_the_same_sample_and_different_seeds_differ(make_llm):
    llm = make_llm()
    params = lambda seed: SamplingParams(temperature=1.0, top_p=0.95, top_k=50, max_tokens=16,  # noqa: E731
                                         seed=seed, ignore_eos=True)
    first = llm.generate("Once upon a time", params(7))[0].outputs[0].token_ids
    again = llm.generate(["Hello", "Once upon a time", "Why"], params(7))[1].outputs[0].token_ids
    other = llm.generate("Once upon a time", params(8))[0].outputs[0].token_ids
    assert first == again
    assert first != other


def test_prompt_as_token_ids_and_bad_prompts(make_llm):
    llm = make_llm()
    ids = llm.tokenizer.encode("The capital of France is")
    by_ids = llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    by_text = llm.generate("The capital of France is", GREEDY)[0].outputs[0].token_ids
    assert by_ids == by_text
    for bad in ["", [], [[]], [[10 ** 9]], [3.5], None]:
        with pytest.raises(ValueError):
            llm.generate(bad, GREEDY)
    assert _all_blocks_free(llm.engine) and not llm.engine.has_unfinished_requests()


def test_prompt_longer_than_the_context_is_rejected(make_llm):
    llm = make_llm(max_model_len=64)
    with pytest.raises(ValueError, match="context"):
        llm.generate("word " * 100, GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("word " * 30, SamplingParams(max_tokens=60))


def test_abort_frees_everything_at_any_moment(make_llm):
    engine = make_llm(max_num_batched_tokens=8).engine
    engine.add_request("waiting", "A long prompt that is chunked over several steps of prefill", GREEDY)
    engine.add_request("other", "Hi", GREEDY)
    engine.step()  # "waiting" is mid-prefill now
    out = engine.abort("waiting")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.abort("other") is None
    assert _all_blocks_free(engine)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("max_tokens", 0),
    ("min_p", 2.0), ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("n", 0),
    ("logprobs", 21), ("stop", [""]), ("stop", 5), ("seed", "x"), ("min_tokens", -1),
    ("logit_bias", {"a": 1}), ("logit_bias", {"5": 200}),
])
def test_sampling_params_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_engine_config_validation_names_the_field():
    for field, value in [("max_num_seqs", 0), ("block_size", 0), ("policy", "random"), ("dtype", "int8")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: value})


def test_default_model_loads_with_no_arguments():
    llm = LLM()
    assert llm.engine.model_config.num_layers == 30


def test_the_offline_llm_takes_whole_steps_unless_told(checkpoint):
    """Every request of a generate() call is there from the start: the LLM class's steps take the
    whole budget (the server's short CPU steps cost a batch of prompts ~35%), unless asked."""
    from ember_cupy import LLM
    whole = LLM(checkpoint, max_num_batched_tokens=512)
    assert whole.engine.config.max_num_prefill_tokens == 512
    outputs = whole.generate([[1000 * k + i for i in range(300)] for k in (1, 2, 3)], SamplingParams(max_tokens=1))
    assert whole.engine.last_step_num_tokens == 3 * 300 - 512 and len(outputs) == 3
    assert LLM(checkpoint, max_num_prefill_tokens=32).engine.config.max_num_prefill_tokens == 32


def test_generate_and_chat_without_params_take_the_generation_defaults(make_llm):
    """No SamplingParams: the engine's defaults (--override-generation-config) fill them."""
    llm = make_llm(override_generation_config={"max_new_tokens": 3, "temperature": 0})
    out = llm.generate("The capital of France is")[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    assert len(llm.chat([{"role": "user", "content": "Hi"}])[0].outputs[0].token_ids) <= 3
