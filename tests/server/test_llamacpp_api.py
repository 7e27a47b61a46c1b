"""llama.cpp's native server API (/completion, /completions, /apply-template, /props and the
`content` form of /tokenize and /detokenize) over raw HTTP, as llama-server's clients speak it, on
the real model. /completion runs on the completion path: a greedy result equals the /v1/completions
completion of the same prompt, and llama-server's sampling defaults become the same sampling
parameters a /v1/completions request would give."""
from __future__ import annotations

import json
import os
import sys

import pytest
from server_helpers import MAX_MODEL_LEN, MODEL, documented, http

jsonschema = pytest.importorskip("jsonschema")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "n_predict": 8}


def complete(base_url: str, **fields) -> dict:
    status, _, raw = http(base_url, "POST", "/completion", {"prompt": PROMPT, **GREEDY, **fields})
    assert status == 200, raw
    return json.loads(raw)


def openai_completion(client, prompt=PROMPT, **fields):
    fields = {"max_tokens": 8, "temperature": 0, **fields}
    extra = {k: fields.pop(k) for k in ("top_k", "min_p", "repetition_penalty") if k in fields}
    return client.completions.create(model=MODEL, prompt=prompt, extra_body=extra or None, **fields)


def events(raw: bytes) -> list[dict]:
    """A /completion stream's events: `data:` lines of JSON (no [DONE])."""
    lines = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in lines
    return [json.loads(line) for line in lines]


def refusal(base_url: str, path: str, body) -> tuple[int, dict]:
    status, _, raw = http(base_url, "POST", path, body)
    return status, json.loads(raw)["error"]


# --- /completion ---------------------------------------------------------------------------------
def test_a_greedy_completion_is_the_openai_completion_of_its_prompt(base_url, client, spec):
    result = complete(base_url)
    same = openai_completion(client)
    assert result["content"] == same.choices[0].text and result["stop"] is True
    assert (result["tokens_predicted"], result["tokens_evaluated"]) == (same.usage.completion_tokens,
                                                                        same.usage.prompt_tokens)
    assert (result["stop_type"], result["stopping_word"], result["truncated"]) == ("limit", "", False)
    assert result["model"] == MODEL and result["prompt"] == PROMPT and result["tokens"] == []
    timings = result["timings"]
    assert timings["predicted_n"] == 8 and timings["prompt_n"] + timings["cache_n"] == result["tokens_evaluated"]
    assert timings["predicted_ms"] > 0 and timings["predicted_per_second"] > 0
    settings = result["generation_settings"]
    assert (settings["n_predict"], settings["temperature"], settings["top_k"], settings["n_ctx"]) == (8, 0, 40, MAX_MODEL_LEN)
    documented(spec, "LlamaCppResults", result)
    assert http(base_url, "POST", "/completions", {"prompt": PROMPT, **GREEDY})[2] != b""


def test_a_stream_is_events_that_add_up_to_the_result(base_url, spec):
    whole = complete(base_url, return_tokens=True)
    status, headers, raw = http(base_url, "POST", "/completion", {"prompt": PROMPT, **GREEDY, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    parts = events(raw)
    assert [p["stop"] for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p["content"] for p in parts) == whole["content"]
    assert [t for p in parts for t in p["tokens"]] == whole["tokens"] and len(whole["tokens"]) == 8
    assert [p["tokens_predicted"] for p in parts[:-1]] == sorted(p["tokens_predicted"] for p in parts[:-1])
    last = parts[-1]
    assert (last["content"], last["stop_type"], last["tokens_predicted"]) == ("", "limit", 8)
    for part in parts:
        documented(spec, "LlamaCppCompletion", part)


def test_a_stop_word_ends_the_text_and_is_named(base_url):
    text = complete(base_url, n_predict=12)["content"]
    word = text.split()[len(text.split()) // 2]
    result = complete(base_url, n_predict=12, stop=["never seen", word])
    assert (result["content"], result["stop_type"], result["stopping_word"]) == (text[:text.find(word)], "word", word)


def test_the_applied_template_completes_to_the_end_of_the_turn(base_url, client):
    ask = [{"role": "user", "content": "Say hello."}]
    status, _, raw = http(base_url, "POST", "/apply-template", {"messages": ask})
    assert status == 200
    prompt = json.loads(raw)["prompt"]
    assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n")
    result = complete(base_url, prompt=prompt, n_predict=64)
    chat = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=64, temperature=0)
    assert result["content"] == chat.choices[0].message.content
    assert (result["stop_type"], chat.choices[0].finish_reason) == ("eos", "stop")


def test_mixed_and_several_prompts(base_url, client):
    ids = json.loads(http(base_url, "POST", "/tokenize", {"content": "The capital of"})[2])["tokens"]
    mixed = complete(base_url, prompt=[*ids, " France is"])
    assert mixed["content"] == complete(base_url)["content"] and mixed["prompt"] == PROMPT
    results = complete(base_url, prompt=["Hello", [*ids, " France is"]])
    assert [r["index"] for r in results] == [0, 1]
    assert results[0]["content"] == openai_completion(client, "Hello").choices[0].text
    assert results[1]["content"] == mixed["content"]


def test_n_probs_gives_the_top_logprobs_of_each_token(base_url, client):
    result = complete(base_url, n_probs=3, n_predict=4)
    same = openai_completion(client, logprobs=3, max_tokens=4).choices[0].logprobs
    probabilities = result["completion_probabilities"]
    assert len(probabilities) == 4
    for entry, logprob, top in zip(probabilities, same.token_logprobs, same.top_logprobs):
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["id"] == entry["id"]
        assert entry["logprob"] == pytest.approx(logprob, abs=1e-5)
        assert {t["token"]: t["logprob"] for t in entry["top_logprobs"]} == pytest.approx(top, abs=1e-5)
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    streamed = events(http(base_url, "POST", "/completion", {"prompt": PROMPT, **GREEDY, "n_predict": 4,
                                                             "n_probs": 3, "stream": True})[2])
    assert [e for part in streamed for e in part.get("completion_probabilities", [])] == probabilities


def test_llama_servers_defaults_sample_as_the_same_openai_fields(base_url, client):
    seeded = {"seed": 7, "n_predict": 12}
    first = complete(base_url, temperature=0.8, **seeded)["content"]
    assert first == complete(base_url, **{**seeded, "temperature": 0.8})["content"]
    defaults = dict(temperature=0.8, top_p=0.95, seed=7, max_tokens=12, top_k=40, min_p=0.05)
    assert first == openai_completion(client, **defaults).choices[0].text
    only_temperature = complete(base_url, temperature=1.5, samplers=["temperature"], **seeded)["content"]
    assert only_temperature == openai_completion(client, temperature=1.5, seed=7, max_tokens=12).choices[0].text
    top_two = complete(base_url, temperature=1.5, top_k=2, samplers=["top_k", "temperature"], **seeded)["content"]
    assert top_two == openai_completion(client, temperature=1.5, top_k=2, seed=7, max_tokens=12).choices[0].text
    assert top_two != only_temperature   # top_k bound the draw
    penalised = complete(base_url, temperature=0, repeat_penalty=1.5, presence_penalty=0.5, n_predict=12)["content"]
    assert penalised == openai_completion(client, max_tokens=12, presence_penalty=0.5,
                                          repetition_penalty=1.5).choices[0].text
    assert complete(base_url, repeat_penalty=1.5, repeat_last_n=0, n_predict=12)["content"] == \
        complete(base_url, n_predict=12)["content"]


def test_logit_bias_by_id_by_text_and_false(base_url):
    greedy = complete(base_url, n_predict=1, n_probs=2)
    first, second = (entry["id"] for entry in greedy["completion_probabilities"][0]["top_logprobs"])
    banned = complete(base_url, n_predict=1, logit_bias=[[first, False]], return_tokens=True)
    assert banned["tokens"] == [second]
    assert banned["generation_settings"]["logit_bias"] == [[first, -100.0]]
    text = greedy["content"]
    by_text = complete(base_url, n_predict=1, logit_bias={text: -100}, return_tokens=True)
    assert by_text["tokens"] == [second]
    favoured = complete(base_url, n_predict=1, logit_bias={str(second): 100}, return_tokens=True)
    assert favoured["tokens"] == [second]


def test_grammar_and_json_schema_constrain_the_text(base_url):
    answer = complete(base_url, prompt="Is the sky blue? Answer:", grammar='root ::= " yes" | " no"', n_predict=8)
    assert answer["content"] in (" yes", " no") and answer["stop_type"] == "eos"
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    result = complete(base_url, prompt="The capital of France as JSON:", json_schema=schema, n_predict=40)
    jsonschema.validate(json.loads(result["content"]), schema)


def test_response_fields_keep_and_lift_fields(base_url):
    result = complete(base_url, response_fields=["content", "generation_settings/n_predict", "absent/x"])
    assert set(result) == {"content", "generation_settings/n_predict"} and result["generation_settings/n_predict"] == 8
    streamed = events(http(base_url, "POST", "/completion", {"prompt": PROMPT, **GREEDY, "stream": True,
                                                             "response_fields": ["stop_type"]})[2])
    assert streamed[-1] == {"stop_type": "limit"} and all(e["stop"] is False for e in streamed[:-1])


def test_n_predict_zero_generates_nothing(base_url):
    result = complete(base_url, n_predict=0)
    assert (result["content"], result["tokens_predicted"], result["stop_type"]) == ("", 0, "limit")
    assert result["tokens_evaluated"] == 5 and result["timings"]["prompt_n"] == 0


def test_a_prompt_past_the_context_is_refused_and_a_long_n_predict_stops_where_it_ends(base_url):
    ids = json.loads(http(base_url, "POST", "/tokenize", {"content": "word " * 600})[2])["tokens"]
    status, error = refusal(base_url, "/completion", {"prompt": ids})
    assert status == 400 and "context" in error["message"], error
    for n_predict in (-1, 10_000):   # as llama-server: the text stops where the context is full
        fits = complete(base_url, prompt=ids[:MAX_MODEL_LEN - 6], n_predict=n_predict, ignore_eos=True)
        assert (fits["tokens_predicted"], fits["stop_type"], fits["truncated"]) == (6, "limit", True)
    assert complete(base_url, prompt=ids[:MAX_MODEL_LEN - 6], n_predict=5, ignore_eos=True)["truncated"] is False


def test_a_client_that_leaves_mid_stream_aborts_its_request(base_url):
    from server_helpers import leaving_mid_stream_aborts
    leaving_mid_stream_aborts(base_url, "/completion", {"prompt": "Tell me a story.", "n_predict": 400,
                                                        "temperature": 0, "stream": True, "ignore_eos": True},
                              line_start=b"data: ")


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": PROMPT, "mirostat": 2}, "mirostat", "not supported"),
    ({"prompt": PROMPT, "typical_p": 0.5}, "typical_p", "not supported"),
    ({"prompt": PROMPT, "dry_multiplier": 0.8}, "dry_multiplier", "not supported"),
    ({"prompt": PROMPT, "lora": [{"id": 0, "scale": 1}]}, "lora", "LoRA"),
    ({"prompt": PROMPT, "bogus": 1}, "bogus", "bogus"),
    ({"prompt": PROMPT, "n_predict": "8"}, "n_predict", "integer"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [1, 99999999]}, "prompt", "vocabulary"),
    ({"prompt": {"prompt_string": "x", "multimodal_data": ["aGk="]}}, "prompt", "multimodal"),
    ({"prompt": ["a", "b"], "stream": True}, "prompt", "one prompt"),
    ({"prompt": PROMPT, "grammar": "root ::= \"a\"", "json_schema": {}}, None, "either"),
    ({"prompt": PROMPT, "grammar": "root ::= nothing_defined"}, None, "grammar"),
    ({"prompt": PROMPT, "logit_bias": [[1, "x"]]}, "logit_bias", "bias"),
    ({"prompt": PROMPT, "samplers": ["beam"]}, "samplers[0]", "beam"),
    ({"prompt": PROMPT, "model": "gpt-4"}, "model", "gpt-4"),
    ({}, "prompt", "required"),
])
def test_bad_completions_are_400s_naming_the_field(base_url, body, param, words):
    status, error = refusal(base_url, "/completion", body)
    assert status in (400, 404) and error["param"] == param and words in error["message"], error


# --- tokenizer and server ------------------------------------------------------------------------
def test_tokenize_and_detokenize_in_llama_servers_form(base_url):
    status, _, raw = http(base_url, "POST", "/tokenize", b'{"content": "Hi \\u00e1<|im_end|>"}',
                          {"Content-Type": "application/x-www-form-urlencoded"})   # curl -d's type
    assert status == 200
    ids = json.loads(raw)["tokens"]
    assert ids[-1] == 2 and all(isinstance(t, int) for t in ids)
    pieces = json.loads(http(base_url, "POST", "/tokenize", {"content": "Hi \u00e1\U0001F680",
                                                             "with_pieces": True})[2])["tokens"]
    assert "".join(p["piece"] for p in pieces if isinstance(p["piece"], str)).startswith("Hi ")
    rocket = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert rocket.decode() == "Hi \u00e1\U0001F680" and any(isinstance(p["piece"], list) for p in pieces)
    text = json.loads(http(base_url, "POST", "/detokenize", {"tokens": ids[:-1]})[2])
    assert text["content"] == text["prompt"] == "Hi \u00e1"
    status, error = refusal(base_url, "/tokenize", {"content": "x", "prompt": "y"})
    assert status == 400 and "exactly one" in error["message"]
    status, error = refusal(base_url, "/tokenize", {"content": "x", "parse_special": False})
    assert status == 400 and error["param"] == "parse_special"


def test_props_describe_the_server(base_url, spec):
    status, _, raw = http(base_url, "GET", "/props")
    assert status == 200
    props = json.loads(raw)
    documented(spec, "LlamaCppProps", props)
    info = json.loads(http(base_url, "GET", "/tokenizer_info")[2])
    assert props["chat_template"] == info["chat_template"] and props["eos_token"] == "<|im_end|>"
    assert props["default_generation_settings"]["n_ctx"] == MAX_MODEL_LEN and props["model_alias"] == MODEL
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    assert props["total_slots"] >= 1 and props["model_path"].endswith(".gguf")


# --- llama-server's own answers (tools/make_llamacpp_api_fixture.py) ------------------------------
@pytest.fixture(scope="module")
def recorded():
    with open(os.path.join(os.path.dirname(__file__), "..", "fixtures", "llamacpp_api.json")) as f:
        return json.load(f)


def same_fields(ours: dict, theirs: dict[str, str]) -> None:
    """ours has every field llama-server's answer has, each of the same JSON type."""
    from make_llamacpp_api_fixture import shape
    assert {k: v for k, v in shape(ours).items() if k in theirs} == theirs, sorted(set(theirs) - set(ours))


def test_results_and_events_have_llama_servers_fields(base_url, recorded):
    greedy = {"prompt": recorded["prompt"], "n_predict": 4, "temperature": 0}
    result = complete(base_url, **greedy, n_probs=2, return_tokens=True)
    same_fields(result, recorded["completion"])
    same_fields(result["timings"], recorded["timings"])
    same_fields(result["completion_probabilities"][0], recorded["probability"])
    same_fields(result["completion_probabilities"][0]["top_logprobs"][0], recorded["top_probability"])
    parts = events(http(base_url, "POST", "/completion", {**greedy, "stream": True})[2])
    same_fields(parts[0], recorded["stream_event"])
    same_fields(parts[-1], recorded["stream_last"])
    assert [p["stop"] for p in parts] == recorded["stream_stops"]   # one event per token here too
    props = json.loads(http(base_url, "GET", "/props")[2])
    same_fields(props, recorded["props"])


def test_tokenizer_and_template_answer_as_llama_server(base_url, recorded):
    for text, ids in recorded["tokenize"].items():
        assert json.loads(http(base_url, "POST", "/tokenize", {"content": text})[2])["tokens"] == ids, text
    for text, pieces in recorded["pieces"].items():
        ours = json.loads(http(base_url, "POST", "/tokenize", {"content": text, "with_pieces": True})[2])
        assert ours["tokens"] == pieces, text
    ids = recorded["tokenize"][list(recorded["tokenize"])[1]]
    assert json.loads(http(base_url, "POST", "/detokenize", {"tokens": ids})[2])["content"] == \
        recorded["detokenize"]["content"]
    prompt = json.loads(http(base_url, "POST", "/apply-template", {"messages": recorded["messages"]})[2])
    assert prompt == recorded["apply_template"]
