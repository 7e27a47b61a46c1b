"""Issue 27 through HTTP: a server started with a speculative config replies as the plain one,
counts vLLM's spec_decode_* series, and honours a request's `"speculative": false`; with prompt
lookup, and with a draft model (the default model drafting for itself)."""
from __future__ import annotations

import json

import pytest
from server_helpers import MODEL, http, metric
from step_cost_stand_ins import FreeDrafting, FreeVerification

from ember_cupy.engine.llm_engine import LLMEngine
from ember_cupy.model.loader import default_model_path

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door."
PROMPT = f"Copy this sentence.\nSentence: {TEXT}\nCopy: The quick brown"
DRAFTS = "vllm:spec_decode_num_drafts_total"


def _always_speculating(checkpoint, config):
    engine = LLMEngine(checkpoint, config)
    engine.speculator.costs = FreeVerification()
    return engine


def _always_drafting(checkpoint, config):
    engine = _always_speculating(checkpoint, config)
    engine.speculator.proposer.costs = FreeDrafting()
    return engine


@pytest.fixture(scope="module")
def spec_url(start_server):
    return start_server(engine_factory=_always_speculating, speculative_config=NGRAM).url


def _complete(url: str, **fields) -> tuple[int, dict]:
    status, _, raw = http(url, "POST", "/v1/completions",
                          {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, **fields})
    return status, json.loads(raw)


def test_speculative_server_replies_as_the_plain_one_and_counts_drafts(spec_url, base_url):
    status, reply = _complete(spec_url)
    assert status == 200, reply
    assert reply["choices"][0]["text"] == _complete(base_url)[1]["choices"][0]["text"]
    drafts, accepted = metric(spec_url, DRAFTS), metric(spec_url, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= metric(spec_url, "vllm:spec_decode_num_draft_tokens_total")
    per_position = [metric(spec_url, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
                    for p in range(3)]
    assert per_position[0] > 0 and sum(per_position) == accepted
    assert metric(spec_url, "ember:spec_decode_num_drafts_total") == drafts
    assert metric(base_url, DRAFTS) is None   # served only where speculation is configured


def test_a_request_opts_out_with_speculative_false(spec_url):
    before = metric(spec_url, DRAFTS) or 0
    status, reply = _complete(spec_url, speculative=False)
    assert status == 200, reply
    assert metric(spec_url, DRAFTS) == before
    status, reply = _complete(spec_url, speculative="sometimes")
    assert status == 400 and reply["error"]["param"] == "speculative", reply


def test_a_draft_model_server_replies_as_the_plain_one_and_counts_drafts(start_server, base_url):
    draft = {"model": default_model_path(), "num_speculative_tokens": 3}
    url = start_server(engine_factory=_always_drafting, speculative_config=draft).url
    status, reply = _complete(url, prompt="The capital of France is", ignore_eos=True)
    assert status == 200, reply
    assert reply["choices"][0]["text"] == _complete(base_url, prompt="The capital of France is",
                                                    ignore_eos=True)[1]["choices"][0]["text"]
    drafts, accepted = metric(url, DRAFTS), metric(url, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= metric(url, "vllm:spec_decode_num_draft_tokens_total")


def _streamed(url: str, **fields) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of a streamed completion."""
    status, _, raw = http(url, "POST", "/v1/completions",
                          {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}, **fields})
    assert status == 200, raw[:300]
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    return ("".join(c["text"] for c in choices), [c["finish_reason"] for c in choices if c["finish_reason"]][0],
            chunks[-1]["usage"]["completion_tokens"])


def test_a_stop_string_inside_accepted_drafts_ends_the_reply_as_the_plain_one(spec_url, base_url):
    """The output processor finds a stop string on the event loop, after the step that verified
    drafts past it: those tokens are taken back before the next step, so text, finish reason,
    usage and logprobs are the plain server's, streamed or not, and no KV page stays held."""
    fields = {"stop": [" jumps"], "logprobs": 1}   # two drafts verified past it
    drafts = metric(spec_url, "vllm:spec_decode_num_accepted_tokens_total")
    status, reply = _complete(spec_url, **fields)
    assert status == 200, reply
    assert metric(spec_url, "vllm:spec_decode_num_accepted_tokens_total") > drafts
    plain = _complete(base_url, **fields)[1]
    choice, plain_choice = reply["choices"][0], plain["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (plain_choice["text"], "stop")
    assert choice["logprobs"]["tokens"] == plain_choice["logprobs"]["tokens"]
    assert reply["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] == \
        len(choice["logprobs"]["tokens"])
    assert _streamed(spec_url, stop=[" jumps"]) == _streamed(base_url, stop=[" jumps"]) == \
        (choice["text"], "stop", reply["usage"]["completion_tokens"])
    assert metric(spec_url, "ember:kv_cache_free_blocks") == metric(spec_url, "ember:kv_cache_total_blocks")
