"""What evaluation harnesses and newer clients send: completions' echo + logprobs
(lm-evaluation-harness's loglikelihood payload), vLLM's prompt_logprobs on both endpoints,
streamed and not, /tokenizer_info; newer OpenAI fields accepted and ignored; priority refused
under a non-priority policy."""
from __future__ import annotations

import json
import math

import pytest
from server_helpers import MODEL, http

from ember_cupy.ops.linear import bf16_prompts_ready

C, CH = "/v1/completions", "/v1/chat/completions"


def post(base_url, path, body) -> dict:
    status, _, raw = http(base_url, "POST", path, {"model": MODEL, **body})
    assert status == 200, raw
    return json.loads(raw)


def stream(base_url, path, body) -> list[dict]:
    status, _, raw = http(base_url, "POST", path, {"model": MODEL, "stream": True, **body})
    assert status == 200, raw
    return [json.loads(line[6:]) for line in raw.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def tokens(base_url, text) -> list[int]:
    status, _, raw = http(base_url, "POST", "/tokenize", {"prompt": text})
    return json.loads(raw)["tokens"]


def test_lm_eval_loglikelihood_payload(base_url):
    """lm-eval's local-completions: token-id prompts, one generated token, echo, logprobs=1,
    then sum(token_logprobs[ctxlen:-1]) and is_greedy from top_logprobs."""
    context = tokens(base_url, "The capital of France is")
    prompts = [context + tokens(base_url, " Paris"), context + tokens(base_url, " a banana")]
    reply = post(base_url, C, {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True,
                               "temperature": 0})
    assert len(reply["choices"]) == 2
    totals = []
    for choice, prompt in zip(sorted(reply["choices"], key=lambda c: c["index"]), prompts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(v <= 0 and math.isfinite(v) for v in lp["token_logprobs"][1:])
        for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]):
            assert token in top and 1 <= len(top) <= 2
        prompt_text = json.loads(http(base_url, "POST", "/detokenize", {"tokens": prompt})[2])["prompt"]
        assert choice["text"].startswith(prompt_text) and len(choice["text"]) > len(prompt_text)
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        totals.append(sum(lp["token_logprobs"][len(context):-1]))
    assert totals[0] > totals[1]   # " Paris" is likelier than " a banana" after that context


def greedy_ids(base_url, context: list[int], n: int) -> list[int]:
    """The n token ids greedy decoding appends to `context`, read as the rank-1 token of the prompt
    pass at each next position (ids, not text: text need not re-tokenize to the same ids)."""
    ids = list(context)
    for _ in range(n):
        body = {"prompt": ids + [ids[-1]], "max_tokens": 1, "prompt_logprobs": 1}   # any token after them
        entry = post(base_url, C, body)["choices"][0]["prompt_logprobs"][-1]
        ids.append(int(next(token for token, e in entry.items() if e["rank"] == 1)))
    return ids[len(context):]


@pytest.mark.parametrize("prompt_activations", ["int8", "auto"])
def test_echoed_prompt_logprobs_equal_generated_ones(start_server, prompt_activations):
    """The logprob the prompt pass gives a token equals the one sampling it gave it: to float
    rounding where prompt rows take the generated tokens' int8 path; within a few hundredths of a
    nat where they run in bf16 (auto, on a CPU with AMX-BF16 tiles or AVX512-BF16: x kept to 8
    bits there, docs/cpu.md; 0.010 nat measured on a Zen 4)."""
    base_url = start_server(prompt_activations=prompt_activations).url
    tolerance = 5e-2 if prompt_activations == "auto" and bf16_prompts_ready() else 2e-3
    context = tokens(base_url, "One, two, three,")
    generated = post(base_url, C, {"prompt": context, "max_tokens": 3, "logprobs": 0, "temperature": 0})
    choice = generated["choices"][0]
    ids = greedy_ids(base_url, context, 3)
    assert json.loads(http(base_url, "POST", "/detokenize", {"tokens": ids})[2])["prompt"] == choice["text"]
    echoed = post(base_url, C, {"prompt": context + ids, "max_tokens": 1, "logprobs": 0, "echo": True,
                                "temperature": 0})["choices"][0]["logprobs"]["token_logprobs"]
    got = echoed[len(context):len(context) + len(ids)]
    assert got == pytest.approx(choice["logprobs"]["token_logprobs"], abs=tolerance)


def test_vllm_prompt_logprobs_on_completions_and_chat(base_url):
    prompt = tokens(base_url, "Hello there, how are you")
    choice = post(base_url, C, {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2})["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for token_id, entry in zip(prompt[1:], entries[1:]):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        ranks = sorted(e["rank"] for e in entry.values() if e["rank"] is not None)
        assert ranks == [1, 2]
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in entry.values())
    assert choice["logprobs"] is None   # logprobs were not asked for
    chat = post(base_url, CH, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                               "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and list(e.values())[0]["rank"] is None for e in chat["prompt_logprobs"][1:])


def test_streamed_echo_with_logprobs_equals_the_full_reply(base_url):
    body = {"prompt": ["Roses are red,", "Two plus two"], "max_tokens": 3, "logprobs": 1, "echo": True,
            "temperature": 0, "prompt_logprobs": 1}
    full = {c["index"]: c for c in post(base_url, C, body)["choices"]}
    chunks = stream(base_url, C, body)
    for index, choice in full.items():
        parts = [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]
        assert "".join(p["text"] for p in parts) == choice["text"]
        streamed = [p["logprobs"] for p in parts if p["logprobs"] is not None]
        for key in ("tokens", "token_logprobs", "text_offset"):
            assert sum((lp[key] for lp in streamed), []) == choice["logprobs"][key], key
        assert [p["prompt_logprobs"] for p in parts if "prompt_logprobs" in p] == [choice["prompt_logprobs"]]


def test_chat_stream_carries_prompt_logprobs_once(base_url):
    chunks = stream(base_url, CH, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                   "prompt_logprobs": 1})
    carried = [c["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c]
    assert len(carried) == 1 and carried[0][0] is None and len(carried[0]) > 3


NEWER_OPENAI_FIELDS = {"reasoning_effort": "low", "verbosity": "low", "prompt_cache_key": "k",
                       "safety_identifier": "u-1", "modalities": ["text"], "web_search_options": {},
                       "prompt_cache_options": {"mode": "implicit"}, "prompt_cache_retention": "24h",
                       "moderation": {"model": "omni-moderation-latest"},
                       "prediction": {"type": "content", "content": "Hello"}, "audio": None,
                       "user": "u", "metadata": {"a": "b"}, "store": False, "service_tier": "auto"}


def test_newer_openai_fields_are_accepted_and_change_nothing(base_url):
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}
    plain = post(base_url, CH, body)
    with_fields = post(base_url, CH, {**body, **NEWER_OPENAI_FIELDS})
    assert with_fields["choices"][0]["message"] == plain["choices"][0]["message"]
    status, _, raw = http(base_url, "POST", CH, {"model": MODEL, **body, "reasoning_effort": 5})
    assert status == 400 and json.loads(raw)["error"]["param"] == "reasoning_effort"


def test_priority_needs_the_priority_policy(base_url, start_server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "priority": -3}
    status, _, raw = http(base_url, "POST", C, body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "priority" and "policy" in error["message"]
    assert http(base_url, "POST", C, {**body, "priority": 0})[0] == 200
    server = start_server(policy="priority", num_kv_blocks=64)
    assert http(server.url, "POST", C, body)[0] == 200


def test_tokenizer_info_describes_the_served_tokenizer(base_url):
    status, _, raw = http(base_url, "GET", "/tokenizer_info")
    assert status == 200, raw
    info = json.loads(raw)
    assert info["vocab_size"] == 49152 and info["model_max_length"] > 0
    assert "<|im_start|>" in info["chat_template"] and "messages" in info["chat_template"]
    status, _, raw = http(base_url, "POST", "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert json.loads(raw)["tokens"] == [info["eos_token_ids"][0]]
