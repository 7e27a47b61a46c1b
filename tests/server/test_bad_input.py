"""Bad input of every kind gets a 4xx with {"error": {message, type, param, code}} (on /v1/messages
Anthropic's {"type": "error", "error": {type, message}}, on /api/ Ollama's {"error": message}, the
message naming the field): never a 500, never a hang, never a leaked KV block."""
from __future__ import annotations

import json

import pytest
from server_helpers import BODY_LIMIT, MAX_MODEL_LEN, MODEL, http, metric

C, CH, R, E = "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"
M, CT = "/v1/messages", "/v1/messages/count_tokens"
OC, OG, OE, OES, OS, OP = "/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show", "/api/pull"
LC, AT = "/completion", "/apply-template"
MSG = [{"role": "user", "content": "hi"}]


def comp(**fields):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **fields}


def chat(**fields):
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **fields}


JSON = {"Content-Type": "application/json"}
LONG_PROMPT = "word " * (MAX_MODEL_LEN + 50)

SURROGATE = "a\ud800b"            # a lone UTF-16 surrogate: json.dumps sends it as the escape \ud800


def deep(depth: int, field: bytes = b"metadata") -> bytes:
    """A body nested `depth` levels deep (~2 KB at 980) in a field the endpoint accepts or ignores."""
    return b'{"prompt": "x", "' + field + b'": ' + b"[" * depth + b"]" * depth + b"}"


# (id, method, path, body, headers, status, param)
CASES = [
    # body syntax, content type, size
    ("malformed-json", "POST", C, b'{"prompt": "x",', JSON, 400, None),
    ("empty-body", "POST", C, b"", JSON, 400, None),
    ("json-array-body", "POST", C, b"[1, 2]", JSON, 400, None),
    ("json-string-body", "POST", CH, b'"hello"', JSON, 400, None),
    ("nan-literal", "POST", C, b'{"prompt": "x", "temperature": NaN}', JSON, 400, None),
    ("not-utf8", "POST", C, b'{"prompt": "\xff\xfe"}', JSON, 400, None),
    ("wrong-content-type", "POST", C, json.dumps(comp()).encode(), {"Content-Type": "text/plain"}, 415, None),
    ("no-content-type", "POST", CH, json.dumps(chat()).encode(), {}, 415, None),
    ("form-content-type", "POST", C, b"prompt=x", {"Content-Type": "application/x-www-form-urlencoded"}, 415, None),
    ("body-too-large", "POST", C, json.dumps(comp(prompt="x" * (BODY_LIMIT + 10))).encode(), JSON, 413, None),
    # routes and methods
    ("unknown-route", "GET", "/v1/nothing", None, {}, 404, None),
    ("wrong-method", "GET", C, None, {}, 405, None),
    ("wrong-method-chat", "PUT", CH, chat(), {}, 405, None),
    ("unknown-model", "POST", C, comp(model="gpt-9"), {}, 404, "model"),
    ("unknown-model-chat", "POST", CH, chat(model="gpt-9"), {}, 404, "model"),
    ("unknown-model-route", "GET", "/v1/models/gpt-9", None, {}, 404, "model"),
    # completions: prompt
    ("missing-prompt", "POST", C, {"model": MODEL}, {}, 400, "prompt"),
    ("empty-prompt", "POST", C, comp(prompt=""), {}, 400, "prompt"),
    ("empty-prompt-list", "POST", C, comp(prompt=[]), {}, 400, "prompt"),
    ("prompt-number", "POST", C, comp(prompt=5), {}, 400, "prompt"),
    ("prompt-mixed-list", "POST", C, comp(prompt=["a", 1]), {}, 400, "prompt"),
    ("prompt-token-out-of-vocab", "POST", C, comp(prompt=[1, 10_000_000]), {}, 400, "prompt"),
    ("prompt-negative-token", "POST", C, comp(prompt=[-1]), {}, 400, "prompt"),
    ("prompt-too-long", "POST", C, comp(prompt=LONG_PROMPT), {}, 400, "prompt"),
    ("prompt-plus-max-tokens-too-long", "POST", C, comp(prompt="hi", max_tokens=MAX_MODEL_LEN), {}, 400, "prompt"),
    # sampling fields: types and ranges
    ("max-tokens-zero", "POST", C, comp(max_tokens=0), {}, 400, "max_tokens"),
    ("max-tokens-string", "POST", C, comp(max_tokens="5"), {}, 400, "max_tokens"),
    ("max-tokens-float", "POST", C, comp(max_tokens=2.5), {}, 400, "max_tokens"),
    ("temperature-negative", "POST", C, comp(temperature=-0.5), {}, 400, "temperature"),
    ("temperature-string", "POST", C, comp(temperature="hot"), {}, 400, "temperature"),
    ("temperature-bool", "POST", C, comp(temperature=True), {}, 400, "temperature"),
    ("top-p-zero", "POST", C, comp(top_p=0), {}, 400, "top_p"),
    ("top-p-above-one", "POST", C, comp(top_p=1.5), {}, 400, "top_p"),
    ("top-k-invalid", "POST", C, comp(top_k=-5), {}, 400, "top_k"),
    ("min-p-above-one", "POST", C, comp(min_p=2), {}, 400, "min_p"),
    ("presence-penalty-range", "POST", C, comp(presence_penalty=3), {}, 400, "presence_penalty"),
    ("frequency-penalty-range", "POST", C, comp(frequency_penalty=-3), {}, 400, "frequency_penalty"),
    ("repetition-penalty-zero", "POST", C, comp(repetition_penalty=0), {}, 400, "repetition_penalty"),
    ("repetition-penalty-tiny", "POST", C, comp(repetition_penalty=1e-300), {}, 400, "repetition_penalty"),
    ("repetition-penalty-huge", "POST", CH, chat(repetition_penalty=1e6), {}, 400, "repetition_penalty"),
    ("prompts-times-n-too-many", "POST", C, comp(prompt=["a"] * 64, n=4), {}, 400, "n"),
    ("n-zero", "POST", C, comp(n=0), {}, 400, "n"),
    ("n-too-large", "POST", C, comp(n=1000), {}, 400, "n"),
    ("logprobs-too-many", "POST", C, comp(logprobs=50), {}, 400, "logprobs"),
    ("logprobs-bool-in-completions", "POST", C, comp(logprobs=True), {}, 400, "logprobs"),
    ("seed-string", "POST", C, comp(seed="abc"), {}, 400, "seed"),
    ("seed-too-large", "POST", C, comp(seed=1 << 70), {}, 400, "seed"),
    ("stop-number", "POST", C, comp(stop=5), {}, 400, "stop"),
    ("stop-empty-string", "POST", C, comp(stop=[""]), {}, 400, "stop"),
    ("stop-too-many", "POST", C, comp(stop=[str(i) for i in range(40)]), {}, 400, "stop"),
    ("stop-too-long", "POST", C, comp(stop=["x" * 1025]), {}, 400, "stop"),
    ("stop-huge-string", "POST", CH, chat(stop="x" * 100_000), {}, 400, "stop"),
    ("stop-token-ids-out-of-vocab", "POST", C, comp(stop_token_ids=[10_000_000]), {}, 400, "stop_token_ids"),
    ("logit-bias-bad-key", "POST", C, comp(logit_bias={"abc": 1}), {}, 400, "logit_bias"),
    ("logit-bias-out-of-range", "POST", C, comp(logit_bias={"5": 500}), {}, 400, "logit_bias"),
    ("logit-bias-out-of-vocab", "POST", C, comp(logit_bias={"99999999": 1}), {}, 400, "logit_bias"),
    ("logit-bias-not-object", "POST", C, comp(logit_bias=[1, 2]), {}, 400, "logit_bias"),
    ("min-tokens-over-max", "POST", C, comp(min_tokens=10, max_tokens=2), {}, 400, "min_tokens"),
    ("stream-not-bool", "POST", C, comp(stream="yes"), {}, 400, "stream"),
    ("stream-options-without-stream", "POST", C, comp(stream_options={"include_usage": True}), {}, 400,
     "stream_options"),
    ("unknown-field", "POST", C, comp(temprature=0.5), {}, 400, "temprature"),
    ("suffix-unsupported", "POST", C, comp(suffix="x"), {}, 400, "suffix"),
    ("prompt-logprobs-too-many", "POST", C, comp(prompt_logprobs=50), {}, 400, "prompt_logprobs"),
    ("prompt-logprobs-bool", "POST", CH, chat(prompt_logprobs=True), {}, 400, "prompt_logprobs"),
    ("echo-not-bool", "POST", C, comp(echo="yes"), {}, 400, "echo"),
    ("best-of-unsupported", "POST", C, comp(best_of=3), {}, 400, "best_of"),
    ("cache-salt-empty", "POST", C, comp(cache_salt=""), {}, 400, "cache_salt"),
    ("priority-string", "POST", C, comp(priority="high"), {}, 400, "priority"),
    ("priority-under-fcfs", "POST", CH, chat(priority=1), {}, 400, "priority"),   # the test server: fcfs
    ("model-not-string", "POST", C, comp(model=5), {}, 400, "model"),
    # chat
    ("missing-messages", "POST", CH, {"model": MODEL}, {}, 400, "messages"),
    ("empty-messages", "POST", CH, chat(messages=[]), {}, 400, "messages"),
    ("messages-not-list", "POST", CH, chat(messages="hi"), {}, 400, "messages"),
    ("message-not-object", "POST", CH, chat(messages=["hi"]), {}, 400, "messages"),
    ("message-bad-role", "POST", CH, chat(messages=[{"role": "wizard", "content": "hi"}]), {}, 400, "messages"),
    ("message-missing-content", "POST", CH, chat(messages=[{"role": "user"}]), {}, 400, "messages"),
    ("message-content-number", "POST", CH, chat(messages=[{"role": "user", "content": 5}]), {}, 400, "messages"),
    ("chat-too-long", "POST", CH, chat(messages=[{"role": "user", "content": LONG_PROMPT}]), {}, 400, "prompt"),
    ("top-logprobs-without-logprobs", "POST", CH, chat(top_logprobs=2), {}, 400, "top_logprobs"),
    ("top-logprobs-too-many", "POST", CH, chat(logprobs=True, top_logprobs=99), {}, 400, "top_logprobs"),
    ("chat-logprobs-int", "POST", CH, chat(logprobs=3), {}, 400, "logprobs"),
    ("max-completion-tokens-zero", "POST", CH, chat(max_completion_tokens=0), {}, 400, "max_completion_tokens"),
    # structured outputs and tools: bad shapes (what they mean to decoding is tested elsewhere)
    ("response-format-unknown-type", "POST", CH, chat(response_format={"type": "xml"}), {}, 400,
     "response_format.type"),
    ("response-format-schema-missing", "POST", CH, chat(response_format={"type": "json_schema"}), {}, 400,
     "response_format"),
    ("response-format-schema-nameless", "POST", CH, chat(response_format={
        "type": "json_schema", "json_schema": {"schema": {}}}), {}, 400, "response_format.json_schema.name"),
    ("structured-outputs-two-kinds", "POST", C, comp(structured_outputs={"regex": "a", "choice": ["a"]}), {}, 400,
     "structured_outputs"),
    ("structured-outputs-json-number", "POST", CH, chat(structured_outputs={"json": 5}), {}, 400,
     "structured_outputs.json"),
    ("structured-outputs-unknown", "POST", CH, chat(structured_outputs={"lark": "x"}), {}, 400,
     "structured_outputs.lark"),
    ("tools-not-list", "POST", CH, chat(tools={"type": "function"}), {}, 400, "tools"),
    ("tool-without-name", "POST", CH, chat(tools=[{"type": "function", "function": {}}]), {}, 400,
     "tools[0].function.name"),
    ("tool-bad-name", "POST", CH, chat(tools=[{"type": "function", "function": {"name": "a b"}}]), {}, 400,
     "tools[0].function.name"),
    ("tool-parameters-not-object", "POST", CH, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": "x"}}]), {}, 400, "tools[0].function.parameters"),
    ("tool-choice-unknown", "POST", CH, chat(tool_choice="sometimes"), {}, 400, "tool_choice"),
    ("tool-choice-named-without-function", "POST", CH, chat(tool_choice={"type": "function"}), {}, 400,
     "tool_choice"),
    ("parallel-tool-calls-string", "POST", CH, chat(parallel_tool_calls="yes"), {}, 400, "parallel_tool_calls"),
    ("tool-message-without-id", "POST", CH, chat(messages=[{"role": "tool", "content": "42"}]), {}, 400,
     "messages[0]"),
    ("tool-call-id-on-user-message", "POST", CH, chat(messages=[{"role": "user", "content": "x",
                                                                  "tool_call_id": "c"}]), {}, 400, "messages[0]"),
    ("message-image-part", "POST", CH, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), {}, 400, "messages[0].content"),
    ("stream-options-unknown-field", "POST", C, comp(stream=True, stream_options={"include_usag": True}), {}, 400,
     "stream_options.include_usag"),
    ("functions-deprecated", "POST", CH, chat(functions=[{"name": "f"}]), {}, 400, "functions"),
    ("assistant-tool-call-arguments-object", "POST", CH, chat(messages=[
        *MSG, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": {"a": 1}}}]}]), {}, 400, "messages[1].tool_calls[0].function.arguments"),
    # text that is not valid Unicode, and JSON nested too deeply, on every JSON endpoint
    ("surrogate-prompt", "POST", C, comp(prompt=SURROGATE), {}, 400, "prompt"),
    ("surrogate-prompt-list", "POST", C, comp(prompt=["ok", SURROGATE]), {}, 400, "prompt"),
    ("surrogate-chat-content", "POST", CH, chat(messages=[{"role": "user", "content": SURROGATE}]), {}, 400,
     "messages"),
    ("surrogate-stop", "POST", CH, chat(stop=[SURROGATE]), {}, 400, "stop"),
    ("surrogate-key", "POST", C, {**comp(), SURROGATE: 1}, {}, 400, None),
    ("surrogate-tokenize", "POST", "/tokenize", {"prompt": SURROGATE}, {}, 400, "prompt"),
    ("surrogate-tokenize-messages", "POST", "/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]},
     {}, 400, "messages"),
    ("surrogate-detokenize", "POST", "/detokenize", {"tokens": [1], "model": SURROGATE}, {}, 400, "model"),
    ("deep-json-980", "POST", C, deep(980), JSON, 400, None),
    ("deep-json-completions", "POST", C, deep(5000), JSON, 400, None),
    ("deep-json-chat", "POST", CH, deep(5000), JSON, 400, None),
    ("deep-json-tokenize", "POST", "/tokenize", deep(5000, b"add_special_tokens"), JSON, 400, None),
    ("deep-json-detokenize", "POST", "/detokenize", b'{"tokens": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     JSON, 400, None),
    ("deep-json-array", "POST", C, b"[" * 5000 + b"]" * 5000, JSON, 400, None),
    ("deep-json-moderate", "POST", C, deep(100), JSON, 400, None),   # decodes, but past MAX_JSON_DEPTH
    # tokenizer routes
    ("tokenize-no-input", "POST", "/tokenize", {"model": MODEL}, {}, 400, "prompt"),
    ("tokenize-prompt-number", "POST", "/tokenize", {"prompt": 5}, {}, 400, "prompt"),
    ("detokenize-missing", "POST", "/detokenize", {}, {}, 400, "tokens"),
    ("detokenize-bad-ids", "POST", "/detokenize", {"tokens": [1, "a"]}, {}, 400, "tokens"),
    ("detokenize-out-of-vocab", "POST", "/detokenize", {"tokens": [10_000_000]}, {}, 400, "tokens"),
    # the Responses API and embeddings
    ("responses-malformed-json", "POST", R, b'{"input": ', JSON, 400, None),
    ("responses-deep-json", "POST", R, deep(5000, b"input"), JSON, 400, None),
    ("responses-unknown-field", "POST", R, {"model": MODEL, "input": "hi", "temprature": 1}, {}, 400, "temprature"),
    ("responses-surrogate-input", "POST", R, {"model": MODEL, "input": SURROGATE}, {}, 400, "input"),
    ("embeddings-malformed-json", "POST", E, b'{"input": ', JSON, 400, None),
    ("embeddings-deep-json", "POST", E, deep(5000, b"input"), JSON, 400, None),
    ("embeddings-missing-input", "POST", E, {"model": MODEL}, {}, 400, "input"),
    ("embeddings-surrogate-input", "POST", E, {"model": MODEL, "input": SURROGATE}, {}, 400, "input"),
    # Anthropic's Messages API
    ("messages-malformed-json", "POST", M, b'{"messages": ', JSON, 400, None),
    ("messages-deep-json", "POST", M, deep(5000, b"messages"), JSON, 400, None),
    ("messages-wrong-content-type", "POST", M, json.dumps(chat()).encode(), {"Content-Type": "text/plain"}, 415, None),
    ("messages-missing-max-tokens", "POST", M, {"model": MODEL, "messages": MSG}, {}, 400, "max_tokens"),
    ("messages-unknown-field", "POST", M, chat(temprature=1), {}, 400, "temprature"),
    ("messages-unknown-model", "POST", M, chat(model="gpt-9"), {}, 404, "gpt-9"),
    ("messages-image-block", "POST", M, chat(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]), {}, 400, "messages[0].content[0]"),
    ("messages-tool-use-from-user", "POST", M, chat(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]), {}, 400, "messages[0]"),
    ("messages-assistant-prefill", "POST", M, chat(messages=[*MSG, {"role": "assistant", "content": "Sure"}]), {},
     400, "prefill"),
    ("messages-surrogate", "POST", M, chat(messages=[{"role": "user", "content": SURROGATE}]), {}, 400, "messages"),
    ("messages-too-long", "POST", M, chat(messages=[{"role": "user", "content": LONG_PROMPT}]), {}, 400, None),
    ("count-tokens-malformed-json", "POST", CT, b'{"messages": ', JSON, 400, None),
    ("count-tokens-missing-messages", "POST", CT, {"model": MODEL}, {}, 400, "messages"),
    # Ollama's API (any Content-Type: its docs' curl examples send none)
    ("ollama-chat-malformed-json", "POST", OC, b'{"messages": ', {}, 400, None),
    ("ollama-chat-cross-site-form", "POST", OC, json.dumps({"model": MODEL, "messages": MSG}).encode(),
     {"Content-Type": "text/plain", "Origin": "http://elsewhere.example"}, 415, "application/json"),
    ("ollama-chat-deep-json", "POST", OC, deep(5000, b"messages"), JSON, 400, None),
    ("ollama-chat-missing-model", "POST", OC, {"messages": MSG}, {}, 400, "model"),
    ("ollama-chat-unknown-model", "POST", OC, {"model": "gpt-9", "messages": MSG}, {}, 404, "gpt-9"),
    ("ollama-chat-bad-role", "POST", OC, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, {},
     400, "messages[0].role"),
    ("ollama-chat-surrogate", "POST", OC, {"model": MODEL, "messages": [{"role": "user", "content": SURROGATE}]},
     {}, 400, "messages"),
    ("ollama-chat-too-long", "POST", OC, {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]},
     {}, 400, "context"),
    ("ollama-generate-malformed-json", "POST", OG, b'{"prompt": ', {}, 400, None),
    ("ollama-generate-negative-context", "POST", OG, {"model": MODEL, "prompt": "x", "context": [-1]}, {}, 400,
     "context"),
    ("ollama-generate-raw-unknown-option", "POST", OG, {"model": MODEL, "prompt": "x", "raw": True,
                                                        "options": {"num_predic": 2}}, {}, 400, "num_predic"),
    ("ollama-embed-malformed-json", "POST", OE, b'{"input": ', {}, 400, None),
    ("ollama-embed-number-input", "POST", OE, {"model": MODEL, "input": 5}, {}, 400, "input"),
    ("ollama-embed-too-many", "POST", OE, {"model": MODEL, "input": ["x"] * 65}, {}, 400, "input"),
    ("ollama-embeddings-malformed-json", "POST", OES, b'{"prompt": ', {}, 400, None),
    ("ollama-embeddings-missing-prompt", "POST", OES, {"model": MODEL}, {}, 400, "prompt"),
    ("ollama-show-malformed-json", "POST", OS, b'{"model": ', {}, 400, None),
    ("ollama-show-unknown-model", "POST", OS, {"model": "gpt-9"}, {}, 404, "gpt-9"),
    ("ollama-pull-malformed-json", "POST", OP, b'{"model": ', {}, 400, None),
    ("ollama-pull-unknown-model", "POST", OP, {"model": "gpt-9"}, {}, 404, "gpt-9"),
    ("ollama-create", "POST", "/api/create", {"model": "x"}, {}, 404, "not supported"),
    # llama-server's API (any Content-Type, as llama-server; from a browser only JSON)
    ("llamacpp-malformed-json", "POST", LC, b'{"prompt": ', {}, 400, None),
    ("llamacpp-other-name-malformed-json", "POST", "/completions", b'{"prompt": ', {}, 400, None),
    ("llamacpp-cross-site-form", "POST", LC, json.dumps({"prompt": "x"}).encode(),
     {"Content-Type": "text/plain", "Origin": "http://elsewhere.example"}, 415, None),
    ("llamacpp-deep-json", "POST", LC, deep(5000, b"stop"), JSON, 400, None),
    ("llamacpp-unknown-field", "POST", LC, {"prompt": "x", "n_predic": 2}, {}, 400, "n_predic"),
    ("llamacpp-other-name-unknown-field", "POST", "/completions", {"prompt": "x", "n_predic": 2}, {}, 400,
     "n_predic"),
    ("llamacpp-mirostat", "POST", LC, {"prompt": "x", "mirostat": 2}, {}, 400, "mirostat"),
    ("llamacpp-surrogate", "POST", LC, {"prompt": SURROGATE}, {}, 400, "prompt"),
    ("llamacpp-too-long", "POST", LC, {"prompt": LONG_PROMPT, "n_predict": 2}, {}, 400, None),
    ("llamacpp-bias-nan-text", "POST", LC, b'{"prompt": "x", "logit_bias": [["a", NaN]]}', {}, 400, None),
    ("llamacpp-unknown-model", "POST", LC, {"prompt": "x", "model": "gpt-9"}, {}, 404, "model"),
    ("apply-template-malformed-json", "POST", AT, b'{"messages": ', {}, 400, None),
    ("apply-template-bad-role", "POST", AT, {"messages": [{"role": "robot", "content": "x"}]}, {}, 400,
     "messages[0].role"),
    ("tokenize-content-and-prompt", "POST", "/tokenize", {"content": "x", "prompt": "y"}, {}, 400, "prompt"),
    ("tokenize-content-surrogate", "POST", "/tokenize", {"content": SURROGATE}, {}, 400, "content"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(base_url, case):
    _, method, path, body, headers, status, param = case
    got, response_headers, raw = http(base_url, method, path, body, headers, timeout=30)
    assert got == status, raw
    assert response_headers.get("Content-Type", "").startswith("application/json")
    if path.startswith("/api/"):
        body = json.loads(raw)
        assert list(body) == ["error"] and isinstance(body["error"], str) and body["error"], body
        assert param is None or param in body["error"], body
        return
    if path.startswith(M):
        body = json.loads(raw)
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error"), body
        assert param is None or param in body["error"]["message"], body
        return
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:   # the field, or a place inside it: messages[0].role is in messages
        assert error["param"] == param or error["param"].startswith((param + "[", param + ".")), error


def test_matrix_reaches_every_json_endpoint(base_url):
    """Each POST route of /openapi.json has a case of bad JSON syntax and one of a bad field."""
    assert len({c[0] for c in CASES}) == len(CASES), "two cases share an id"
    spec = json.loads(http(base_url, "GET", "/openapi.json")[2])
    endpoints = {path for path, item in spec["paths"].items() if "post" in item}
    syntax = {c[2] for c in CASES if c[1] == "POST" and isinstance(c[3], bytes) and c[5] == 400}
    endpoints -= {"/api/create", "/api/copy", "/api/push"}   # not supported: they read no body
    fields = {c[2] for c in CASES if c[1] == "POST" and isinstance(c[3], dict) and c[6] is not None}
    assert endpoints and not endpoints - syntax, f"no bad JSON sent to {sorted(endpoints - syntax)}"
    assert not endpoints - fields, f"no bad field sent to {sorted(endpoints - fields)}"


def test_no_blocks_leaked_by_bad_input(base_url):
    total = metric(base_url, "ember:kv_cache_total_blocks")
    for _ in range(100):  # other tests' requests may still be finishing
        if metric(base_url, "ember:kv_cache_free_blocks") == total and \
                metric(base_url, "ember:num_requests_running") == 0:
            break
        import time
        time.sleep(0.1)
    assert metric(base_url, "ember:kv_cache_free_blocks") == total
    assert metric(base_url, "ember:num_requests_waiting") == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("name", ["add_generation_prompt", "tokenize", "messages", "work_chars", "bos_token"])
def test_chat_template_kwargs_that_collide_with_the_renderers_own_are_400s(base_url, path, name):
    """They were passed on beside the rendering's own arguments: a TypeError, and on /tokenize a 500."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {name: True}}
    status, _, raw = http(base_url, "POST", path, {**body, **({"max_tokens": 1} if "chat" in path else {})})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "chat_template_kwargs" and repr(name) in error["message"], raw
    body["chat_template_kwargs"] = {"enable_thinking": False}      # a template variable of its own: fine
    assert http(base_url, "POST", path, {**body, **({"max_tokens": 1} if "chat" in path else {})})[0] == 200
