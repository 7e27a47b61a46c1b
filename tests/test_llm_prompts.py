"""LLM (the Python API): what generate() / embed() / chat() accept as prompts and parameters: the
forms vLLM's LLM takes (strings, token-id lists, {"prompt"} and {"prompt_token_ids"} dicts), and a
ValueError naming the mistake for anything else, on the real model."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ember_cupy import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def llm(checkpoint):
    from ember_cupy import LLM
    return LLM(checkpoint, max_model_len=512)


def _texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_vllm_prompt_dicts_give_what_their_contents_give(llm):
    ids = llm.tokenizer.encode("The capital of France is")
    plain = _texts(llm.generate(["The capital of France is", ids], GREEDY))
    assert _texts(llm.generate([{"prompt": "The capital of France is"}, {"prompt_token_ids": ids}], GREEDY)) == plain
    assert _texts(llm.generate({"prompt_token_ids": ids}, GREEDY)) == plain[1:]
    assert _texts(llm.generate(np.array(ids, np.int64).tolist(), GREEDY)) == plain[1:]
    assert _texts(llm.generate([list(np.array(ids, np.int32))], GREEDY)) == plain[1:]   # NumPy ints
    [embedded] = llm.embed({"prompt": "Hello"})
    assert np.allclose(embedded.embedding, llm.embed("Hello")[0].embedding)


@pytest.mark.parametrize("prompts, message", [
    ({"prompt": "a", "extra": 1}, r"a prompt dict holds one key.*\['extra', 'prompt'\]"),
    ({"prompt_token_ids": "abc"}, "a prompt dict holds one key"),
    ({"text": "a"}, "a prompt dict holds one key"),
    ([[1.5, 2]], r"prompts\[0\] must be a string or a non-empty list of token ids"),
    (["ok", None], r"prompts\[1\] must be a string"),
    ([[True, False]], r"prompts\[0\] must be"),
    ([], "prompts must be a string, a list of token ids, or a non-empty list"),
])
def test_prompts_of_no_known_form_are_value_errors(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY)


def test_parameters_that_are_not_sampling_params_are_value_errors(llm):
    with pytest.raises(ValueError, match=r"sampling_params must be a SamplingParams .* got dict \(SamplingParams\("):
        llm.generate("Hi", {"max_tokens": 2})      # was: AttributeError inside the engine
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them, got list"):
        llm.generate(["Hi", "Yo"], [GREEDY, "greedy"])
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("messages", [[], "hello", None])
def test_chat_without_a_conversation_is_a_value_error(llm, messages):
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        llm.chat(messages, GREEDY)


def test_vllm_scripts_keyword_arguments_work(llm):
    """vLLM's LLM.generate / chat / embed keywords: sampling_params, use_tqdm, priority,
    pooling_params; lora_request is refused by name (no adapters here), not a TypeError."""
    from ember_cupy.engine.pooling import PoolingParams
    expected = _texts(llm.generate(["Hi", "Yo"], GREEDY))
    assert _texts(llm.generate(["Hi", "Yo"], sampling_params=GREEDY, use_tqdm=False, priority=[0, 0])) == expected
    chat = [{"role": "user", "content": "Say hi."}]
    assert _texts(llm.chat(chat, sampling_params=GREEDY, use_tqdm=False)) == _texts(llm.chat(chat, GREEDY))
    [vector] = llm.embed(["Hello"], pooling_params=PoolingParams(), use_tqdm=False)
    assert np.allclose(vector.embedding, llm.embed("Hello")[0].embedding)
    for call in (lambda: llm.generate("Hi", GREEDY, lora_request=object()),
                 lambda: llm.chat(chat, GREEDY, lora_request=object()),
                 lambda: llm.embed("Hi", lora_request=object())):
        with pytest.raises(ValueError, match="LoRA adapters are not supported"):
            call()
    with pytest.raises(ValueError, match="priority needs the priority scheduling policy"):
        llm.generate(["Hi", "Yo"], GREEDY, priority=[1, 0])
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(["Hi", "Yo"], GREEDY, priority=[0])
    with pytest.raises(ValueError, match="pooling_params must be a PoolingParams, got SamplingParams"):
        llm.embed("Hi", GREEDY)                  # was: a generation request, its embedding None
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them, got dict"):
        llm.chat(chat, {"max_tokens": 2})
    two = [chat, [{"role": "user", "content": "Say bye."}]]
    short, longer = llm.chat(two, [GREEDY, dataclasses.replace(GREEDY, max_tokens=6)])   # one per conversation
    assert (len(short.outputs[0].token_ids), len(longer.outputs[0].token_ids)) == (4, 6)
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.chat(two, [GREEDY])


def test_priority_orders_the_prompts_under_the_priority_policy(checkpoint):
    from ember_cupy import LLM
    llm = LLM(checkpoint, max_model_len=512, policy="priority", max_num_seqs=1)
    late, early = llm.generate(["Hi", "Yo"], GREEDY, priority=[5, 0])     # lower runs first
    assert early.metrics.finished_time < late.metrics.first_scheduled_time


def test_vllm_engine_arguments_are_taken_or_refused_by_name(checkpoint):
    from ember_cupy import LLM
    llm = LLM(checkpoint, max_model_len=512, enforce_eager=True, trust_remote_code=True, swap_space=4,
              tensor_parallel_size=1, tokenizer=None, disable_log_stats=True)
    assert llm.engine.max_model_len == 512 and _texts(llm.generate("Hi", GREEDY))[0]
    with pytest.raises(ValueError, match="tensor_parallel_size 2: ember-cupy runs a model on one device"):
        LLM(checkpoint, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="only the model's own tokenizer"):
        LLM(checkpoint, tokenizer="gpt2")
    with pytest.raises(TypeError, match="bogus"):      # not vLLM's, not ours: Python's own error
        LLM(checkpoint, bogus=1)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    """SamplingParams / PoolingParams truncate_prompt_tokens (vLLM's): the last k tokens run; -1
    keeps as many as leave room for max_tokens (embeddings: the whole context)."""
    from dataclasses import replace
    long_text = "the quick brown fox jumps over the lazy dog " * 80
    ids = llm.tokenizer.encode(long_text)
    assert len(ids) > 512
    [cut] = llm.generate(long_text, replace(GREEDY, truncate_prompt_tokens=30))
    assert cut.prompt_token_ids == ids[-30:] and _texts([cut]) == _texts(llm.generate(ids[-30:], GREEDY))
    [fitted] = llm.generate(ids, replace(GREEDY, truncate_prompt_tokens=-1))
    assert fitted.prompt_token_ids == ids[-(512 - GREEDY.max_tokens):]
    [embedded] = llm.embed(long_text, truncate_prompt_tokens=-1)
    assert embedded.prompt_token_ids == ids[-512:]
    with pytest.raises(ValueError, match="context allows at most"):
        llm.generate(long_text, GREEDY)                       # without it: refused, as before
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1"):
            replace(GREEDY, truncate_prompt_tokens=bad)


def test_detokenize_false_gives_token_ids_without_text(llm):
    from dataclasses import replace
    [text] = llm.generate("The capital of France is", replace(GREEDY, max_tokens=8, logprobs=1))
    [ids] = llm.generate("The capital of France is", replace(GREEDY, max_tokens=8, logprobs=1, detokenize=False))
    assert ids.outputs[0].token_ids == text.outputs[0].token_ids and ids.outputs[0].text == ""
    assert [e.token_id for e in ids.outputs[0].logprobs] == ids.outputs[0].token_ids
    with pytest.raises(ValueError, match="stop strings need the text"):
        SamplingParams(detokenize=False, stop=["."])


def test_a_vllm_script_renders_its_own_chat_prompt(llm):
    """tokenizer = llm.get_tokenizer(); tokenizer.apply_chat_template(..., tokenize=False) as vLLM
    scripts do; tokenize=True gives the ids of that text."""
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Say hi."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert isinstance(text, str) and ids == tokenizer.encode(text, add_special_tokens=False)
    assert _texts(llm.generate({"prompt_token_ids": ids}, GREEDY)) == _texts(llm.chat(messages, GREEDY))


def test_logprobs_read_as_vllms_dicts_of_logprob(llm):
    """A vLLM script's `completion.logprobs[i][token_id].logprob` (and .rank, .items())."""
    [output] = llm.generate("The capital of France is", dataclasses.replace(GREEDY, logprobs=3))
    completion = output.outputs[0]
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in entry and entry[token_id].logprob == entry.logprob
        assert entry[token_id].rank == 1                                   # greedy: the likeliest
        ranks = {token: lp.rank for token, lp in entry.items()}
        assert sorted(ranks.values()) == [1, 2, 3] and len(entry) == 3 and list(entry) == list(ranks)
        assert entry.get(-1) is None
    [sampled] = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=2.0, seed=3,
                                                                        logprobs=1))
    for token_id, entry in zip(sampled.outputs[0].token_ids, sampled.outputs[0].logprobs, strict=True):
        assert entry[token_id].logprob == entry.logprob and len(entry) == (1 if entry.top[0][0] == token_id else 2)
