"""/openapi.json and the server agree: a body the spec's request schema accepts, the server
accepts (200), and one it refuses, the server refuses (400) — each case a mismatch the HTTP
fuzzer found. Where JSON Schema cannot say the rule (best_of must equal n), the spec's
description says it and the error names the field."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import pytest
from server_helpers import MODEL, http

jsonschema = pytest.importorskip("jsonschema")

USER = {"role": "user", "content": "Hi"}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
CHAT = {"model": MODEL, "messages": [USER], "max_tokens": 1}

# (path, body, accepted by both the spec and the server)
CASES = {
    "integral float max_tokens": ("/v1/completions", {**COMPLETION, "max_tokens": 1.0}, True),
    "integral float n, best_of, seed, top_k": (
        "/v1/completions", {**COMPLETION, "n": 1.0, "best_of": 1.0, "seed": 7.0, "top_k": 5.0}, True),
    "integral float token ids": ("/v1/completions", {**COMPLETION, "prompt": [1.0, 2.0],
                                                     "stop_token_ids": [2.0]}, True),
    "fractional max_tokens": ("/v1/completions", {**COMPLETION, "max_tokens": 1.5}, False),
    "boolean max_tokens": ("/v1/completions", {**COMPLETION, "max_tokens": True}, False),
    "integral float max_completion_tokens": ("/v1/chat/completions", {
        **CHAT, "max_completion_tokens": 1.0, "logprobs": True, "top_logprobs": 1.0}, True),
    "digit logit_bias key": ("/v1/completions", {**COMPLETION, "logit_bias": {"42": 1}}, True),
    "non-digit logit_bias key": ("/v1/completions", {**COMPLETION, "logit_bias": {"abc": 1}}, False),
    "empty prompt": ("/v1/completions", {**COMPLETION, "prompt": ""}, False),
    "no prompts": ("/v1/completions", {**COMPLETION, "prompt": []}, False),
    "an empty prompt among prompts": ("/v1/completions", {**COMPLETION, "prompt": ["Hi", ""]}, False),
    "empty token-id prompt": ("/v1/completions", {**COMPLETION, "prompt": [[]]}, False),
    "user message without content": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, False),
    "user message with null content": (
        "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": None}]}, False),
    "assistant message without content": (
        "/v1/chat/completions", {**CHAT, "messages": [USER, {"role": "assistant"}, USER]}, True),
    "tool message without tool_call_id": (
        "/v1/chat/completions", {**CHAT, "messages": [USER, {"role": "tool", "content": "1"}]}, False),
    "user message with tool_call_id": (
        "/v1/chat/completions", {**CHAT, "messages": [{**USER, "tool_call_id": "call_0"}]}, False),
    "user message with tool_calls": ("/v1/chat/completions", {**CHAT, "messages": [{**USER, "tool_calls": [
        {"id": "call_0", "function": {"name": "f", "arguments": "{}"}}]}]}, False),
    "content as text parts": ("/v1/chat/completions", {
        **CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}, True),
    "structured_outputs of one kind": (
        "/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "[0-9]", "choice": None}}, True),
    "structured_outputs of no kind": ("/v1/completions", {**COMPLETION, "structured_outputs": {}}, False),
    "structured_outputs of two kinds": (
        "/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "[0-9]", "choice": ["1"]}}, False),
    "integral float max_output_tokens": ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 1.0}, True),
    "fractional max_output_tokens": ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 1.5}, False),
}
MODELS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
          "/v1/responses": "ResponsesRequest"}


def spec_accepts(spec: dict, path: str, body: dict) -> bool:
    schema = {"$ref": f"#/components/schemas/{MODELS[path]}", "components": spec["components"]}
    return jsonschema.Draft202012Validator(schema).is_valid(body)


@pytest.mark.parametrize("case", list(CASES))
def test_the_spec_and_the_server_agree(spec, base_url, case):
    path, body, accepted = CASES[case]
    assert spec_accepts(spec, path, body) is accepted
    status, _, raw = http(base_url, "POST", path, body)
    assert status == (200 if accepted else 400), raw[:300]
    if not accepted:
        assert json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_best_of_other_than_n_is_documented_and_refused(spec, base_url):
    description = spec["components"]["schemas"]["CompletionRequest"]["properties"]["best_of"]["description"]
    assert "Must equal `n`" in description and "unsupported_parameter" in description
    status, _, raw = http(base_url, "POST", "/v1/completions", {**COMPLETION, "best_of": 2})
    assert status == 400
    error = json.loads(raw)["error"]
    assert (error["param"], error["code"]) == ("best_of", "unsupported_parameter")


def test_text_parts_are_serialized_without_warnings(base_url):
    """The message's content, an array of text parts, goes to the chat template as plain dicts,
    with no pydantic serializer warning (the server runs in this process, in another thread)."""
    body = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                             {"type": "text", "text": " there"}]}]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status, _, raw = http(base_url, "POST", "/v1/chat/completions", body)
        tokenized = http(base_url, "POST", "/tokenize", {"model": MODEL, "messages": body["messages"]})
    assert status == 200, raw[:300]
    assert tokenized[0] == 200, tokenized[2][:300]
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []


def test_the_pages_and_the_metrics_are_documented(spec, base_url):
    for path in ("/", "/docs"):
        content = spec["paths"][path]["get"]["responses"]["200"]["content"]
        assert list(content) == ["text/html"]
        status, headers, _ = http(base_url, "GET", path)
        assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert {"ember:*", "vllm:*"} <= set(spec["paths"]["/metrics"]["get"]["summary"].split())
    names = {line.split("{")[0].split()[0] for line in http(base_url, "GET", "/metrics")[2].decode().splitlines()
             if line and not line.startswith("#")}
    assert {name.split(":")[0] for name in names} == {"ember", "vllm"}


def _unauthenticated(url: str, method: str, path: str) -> int:
    path = path.replace("{model}", MODEL).replace("{response_id}", "resp_unknown")
    return http(url, method.upper(), path, {} if method == "post" else None)[0]


def _serve_help() -> str:
    done = subprocess.run([sys.executable, "-m", "ember_cupy.cli", "serve", "--help"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "1000"})
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())


def _routes_named(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w/])/[\w.*/-]*", text))


def test_the_api_key_guards_exactly_the_operations_the_spec_and_the_help_name(spec, start_server):
    keyed = start_server(settings={"api_key": "sekret"}).url
    api_key_help = _serve_help().rsplit("--api-key API_KEY", 1)[1].split("stay public", 1)[0]
    protected_help, public_help = api_key_help.split(";", 1)
    guarded, public = set(), set()
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            is_guarded = operation.get("security") == [{"bearer": []}, {"apiKey": []}, {}]
            assert (_unauthenticated(keyed, method, path) == 401) is is_guarded, (method, path)
            assert ("401" in operation["responses"]) is is_guarded, (method, path)
            family = next((prefix + "*" for prefix in ("/v1/", "/api/") if path.startswith(prefix)), path)
            (guarded if is_guarded else public).add(family)
    assert "/tokenizer_info" in guarded
    assert _routes_named(protected_help) == guarded | {"/models/load", "/models/unload"}   # the router's
    assert _routes_named(public_help) == public
