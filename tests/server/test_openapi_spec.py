"""/openapi.json is the server's contract: every documented request field is accepted, every
field it does not document is refused, and real replies match the documented response schemas."""
from __future__ import annotations

import json
import re

import pytest
from server_helpers import MODEL, http

jsonschema = pytest.importorskip("jsonschema")

ROUTES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
          "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest",
          "/completion": "LlamaCppCompletionRequest", "/apply-template": "ApplyTemplateRequest"}
# names clients send that neither OpenAI's API nor vLLM's has (and which must stay errors)
FOREIGN = ["temprature", "max_new_tokens", "do_sample", "typical_p"]
# the server's name; one token keeps each request cheap (llama-server's n_predict: absent is -1, no bound)
SERVED = {"model": MODEL, "max_tokens": 1, "n_predict": 1}


def resolve(spec: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def sample(spec: dict, schema: dict, everything: bool = True):
    """A valid value of `schema`: its first example, else one built from its type and bounds
    (objects: every property when `everything`, else the required ones)."""
    schema = resolve(spec, schema)
    if "examples" in schema:
        return schema["examples"][0]
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][-1]
    if "anyOf" in schema:
        return sample(spec, next(s for s in schema["anyOf"] if s.get("type") != "null"), everything)
    kind = schema.get("type")
    if kind == "object":
        names = schema.get("properties", {}) if everything else schema.get("required", [])
        return request_with(spec, schema, list(names), everything)
    if kind == "array":
        return [sample(spec, schema.get("items", {}), everything)] * max(1, schema.get("minItems", 1))
    if kind in ("integer", "number"):
        return schema.get("minimum", schema.get("maximum", 1))
    return {"string": "x", "boolean": True, "null": None}[kind]


def request_with(spec: dict, schema: dict, names: list[str], everything: bool = False) -> dict:
    """An object with the required properties and `names`, honouring the schema's rules between
    fields: one alternative of a oneOf (its rivals' fields left out), dependentSchemas."""
    schema = resolve(spec, schema)
    names = [*schema.get("required", []), *names]
    for alternative in schema.get("oneOf", []):   # keep the first alternative that fits
        rivals = {n for other in schema["oneOf"] if other is not alternative for n in other["required"]}
        if set(alternative["required"]) <= set(names) or alternative is schema["oneOf"][-1]:
            names = [n for n in names if n not in rivals - set(alternative["required"])]
            names += alternative["required"]
            break
    exclusive = schema.get("not", {}).get("required", [])   # fields that may not come together
    if exclusive and set(exclusive) <= set(names):
        names = [n for n in names if n != exclusive[-1]]
    names += [name for name in ("max_tokens", "n_predict") if name in schema["properties"]]   # else: to the
    # end of the context
    body = {name: SERVED.get(name) or sample(spec, schema["properties"][name], everything)
            for name in dict.fromkeys(names)}
    for name, rule in schema.get("dependentSchemas", {}).items():
        if name in body:
            body.update({k: v["const"] for k, v in rule["properties"].items()})
    return body


def post(base_url: str, path: str, body: dict) -> tuple[int, bytes]:
    status, _, raw = http(base_url, "POST", path, body, timeout=60)
    if status == 200 and body.get("stream"):
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" or path == "/completion" and "[DONE]" not in events, raw[-300:]
        assert not any('"error"' in e for e in events[:-1] if e.startswith('{"error"')), raw[-300:]
    return status, raw


def fields(spec: dict) -> list[tuple[str, str]]:
    schemas = spec["components"]["schemas"]
    return [(path, name) for path, model in ROUTES.items() for name in schemas[model]["properties"]]


def test_every_request_schema_is_closed_and_routed(spec):
    for path, model in ROUTES.items():
        assert spec["components"]["schemas"][model]["additionalProperties"] is False
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
    documented = {name for _, name in fields(spec)}
    for name in ("best_of", "suffix", "prompt_logprobs", "tools", "tool_choice", "chat_template_kwargs",
                 "response_format", "structured_outputs", "parallel_tool_calls", "reasoning_effort"):
        assert name in documented, name


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_request_with_every_documented_field_succeeds(spec, base_url, path):
    schema = spec["components"]["schemas"][ROUTES[path]]
    body = request_with(spec, schema, list(schema["properties"]), everything=True)
    if path == "/v1/chat/completions":
        assert {"messages", "tools", "tool_choice", "response_format", "stream_options"} <= set(body)
    status, raw = post(base_url, path, body)
    assert status == 200, (body, raw[:500])


def test_each_documented_field_alone_succeeds(spec, base_url):
    schemas = spec["components"]["schemas"]
    refused = {}
    for path, name in fields(spec):
        body = request_with(spec, schemas[ROUTES[path]], [name])
        status, raw = post(base_url, path, body)
        if status != 200:
            refused[f"{path} {name}"] = (body, raw[:300])
    assert not refused, refused


def test_a_null_field_is_a_field_left_out(base_url):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": None, "stop": None, "logit_bias": None, "seed": None,
            "stream": None, "user": None, "suffix": None, "temprature": None}
    status, raw = post(base_url, "/v1/completions", body)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] <= 16   # max_tokens' default


def test_no_undocumented_field_is_accepted(spec, base_url):
    """Every field some route documents, sent to a route that does not: a 400 naming it."""
    schemas = spec["components"]["schemas"]
    everywhere = {name for _, name in fields(spec)} | set(FOREIGN)
    for path, model in ROUTES.items():
        schema = schemas[model]
        for name in sorted(everywhere - set(schema["properties"])):
            body = request_with(spec, schema, [])
            body[name] = 1
            status, raw = post(base_url, path, body)
            error = json.loads(raw)["error"]
            assert status == 400 and error["param"] == name and error["code"] == "unknown_parameter", \
                (path, name, raw)


# the request fields of openai 3.57.0 (CompletionCreateParams of chat and of completions, + stream)
OPENAI_FIELDS = {
    "ChatCompletionRequest": [
        "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
        "max_completion_tokens", "max_tokens", "messages", "metadata", "modalities", "model", "moderation",
        "n", "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
        "prompt_cache_options", "prompt_cache_retention", "reasoning_effort", "response_format",
        "safety_identifier", "seed", "service_tier", "stop", "store", "stream", "stream_options",
        "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
        "web_search_options"],
    "CompletionRequest": [
        "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "model", "n",
        "presence_penalty", "prompt", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
        "top_p", "user"],
}


def test_every_openai_request_field_is_documented(spec):
    """None of OpenAI's fields is an 'unrecognized argument': each is served, ignored, or (the
    deprecated function calling, suffix) refused by name, as its description says."""
    for model, names in OPENAI_FIELDS.items():
        missing = set(names) - set(spec["components"]["schemas"][model]["properties"])
        assert not missing, (model, missing)


def test_deprecated_function_calling_is_refused_by_name(base_url):
    status, raw = post(base_url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
        "functions": [{"name": "f", "parameters": {}}]})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "functions" and error["code"] == "unsupported_parameter"


def validator(spec: dict, model: str):
    schema = {"$ref": f"#/components/schemas/{model}", "components": spec["components"]}
    return jsonschema.Draft202012Validator(schema)


def sse_chunks(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


REPLIES = [
    ("/v1/completions", {"prompt": ["Hi", "Yo"], "max_tokens": 3, "logprobs": 2, "n": 2, "seed": 1},
     "Completion"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "echo": True, "stop": ["\n"]}, "Completion"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                              "logprobs": True, "top_logprobs": 2}, "ChatCompletion"),
    ("/tokenize", {"prompt": "Hi", "return_token_strs": True}, "TokenizeResponse"),
    ("/detokenize", {"tokens": [1, 2]}, "DetokenizeResponse"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "ErrorResponse"),
]
STREAMS = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "logprobs": 1, "echo": False,
                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "Completion"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2,
                              "logprobs": True, "stream_options": {"include_usage": True}},
     "ChatCompletionChunk"),
]


@pytest.mark.parametrize("path,body,model", REPLIES, ids=[f"{p} {m}" for p, _, m in REPLIES])
def test_replies_match_the_documented_schema(spec, base_url, path, body, model):
    status, raw = post(base_url, path, body)
    assert status == (400 if model == "ErrorResponse" else 200), raw
    validator(spec, model).validate(json.loads(raw))


@pytest.mark.parametrize("path,body,model", STREAMS, ids=[m for *_, m in STREAMS])
def test_stream_chunks_match_the_documented_schema(spec, base_url, path, body, model):
    status, raw = post(base_url, path, {**body, "stream": True})
    assert status == 200, raw
    chunks = sse_chunks(raw)
    assert len(chunks) >= 3
    check = validator(spec, model)
    for chunk in chunks:
        check.validate(chunk)


def test_models_and_health_match_the_documented_schema(spec, base_url):
    for path, model in (("/v1/models", "ModelList"), (f"/v1/models/{MODEL}", "ModelCard"),
                        ("/health", "HealthResponse"), ("/tokenizer_info", "TokenizerInfoResponse")):
        status, _, raw = http(base_url, "GET", path)
        assert status == 200
        validator(spec, model).validate(json.loads(raw))


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
TOOL_CALL = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
             "tool_choice": "required", "max_tokens": 40, "temperature": 0}


def test_tool_call_replies_match_the_documented_schema(spec, base_url):
    status, raw = post(base_url, "/v1/chat/completions", {"model": MODEL, **TOOL_CALL})
    assert status == 200, raw
    reply = json.loads(raw)
    validator(spec, "ChatCompletion").validate(reply)
    assert reply["choices"][0]["finish_reason"] == "tool_calls" and reply["choices"][0]["message"]["tool_calls"]
    status, raw = post(base_url, "/v1/chat/completions", {"model": MODEL, **TOOL_CALL, "stream": True})
    chunks = sse_chunks(raw)
    check = validator(spec, "ChatCompletionChunk")
    for chunk in chunks:
        check.validate(chunk)
    assert any(c["delta"].get("tool_calls") for chunk in chunks for c in chunk["choices"])


def test_every_route_is_documented_with_its_path_parameters(spec, server):
    served = {(route.method.lower(), route.resource.canonical) for route in server.server.app.router.routes()
              if route.method not in ("HEAD", "OPTIONS", "*")}
    assert served == {(method, path) for path, item in spec["paths"].items() for method in item}
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            declared = [(p["name"], p["in"], p["required"], p["schema"]) for p in operation.get("parameters", [])]
            expected = [(name, "path", True, {"type": "string"}) for name in re.findall(r"\{(\w+)\}", path)]
            assert declared == expected, (method, path)
            assert all(p["description"] for p in operation.get("parameters", [])), (method, path)
