"""Chat-template rendering details: tojson's formatting arguments (as transformers' filter),
add_generation_prompt=false and extra template variables (chat_template_kwargs), through the
Python API, the tokenizer and the HTTP server's chat route."""
import json
import urllib.request

import pytest

from ember_cupy import LLM, SamplingParams
from ember_cupy.chat_template import ChatTemplate
from tiny_model import write_tiny_checkpoint

MESSAGES = [{"role": "user", "content": "w1 w2"}]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}")


@pytest.mark.parametrize("call,expected", [
    ("{{ x | tojson }}", '{"b": [1, 2], "a": "é"}'),
    ("{{ x | tojson(indent=2) }}", '{\n  "b": [\n    1,\n    2\n  ],\n  "a": "é"\n}'),
    ("{{ x | tojson(separators=(',', ':')) }}", '{"b":[1,2],"a":"é"}'),
    ("{{ x | tojson(sort_keys=true) }}", '{"a": "é", "b": [1, 2]}'),
    ("{{ x | tojson(separators=(',', ':'), sort_keys=true) }}", '{"a":"é","b":[1,2]}'),
])
def test_tojson_takes_transformers_arguments(call, expected):
    template = ChatTemplate(call)
    assert template.render([{"role": "user", "content": ""}], x={"b": [1, 2], "a": "é"}) == expected


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("template_model")
    write_tiny_checkpoint(path)
    config_file = path / "tokenizer_config.json"
    config = json.load(open(config_file))
    config["chat_template"] = TEMPLATE
    json.dump(config, open(config_file, "w"))
    return str(path)


def test_generation_prompt_and_kwargs_in_the_tokenizer(model_dir):
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4)
    render = llm.tokenizer.apply_chat_template
    assert render(MESSAGES) == "<user>w1 w2<assistant>"
    assert render(MESSAGES, add_generation_prompt=False) == "<user>w1 w2"
    assert render(MESSAGES, enable_thinking=False) == "<user>w1 w2<assistant><no_think>"
    with_prompt = llm.chat(MESSAGES, SamplingParams(max_tokens=1))[0].prompt_token_ids
    without = llm.chat(MESSAGES, SamplingParams(max_tokens=1), add_generation_prompt=False)[0].prompt_token_ids
    assert without == llm.tokenizer.encode(render(MESSAGES, add_generation_prompt=False), add_special_tokens=False)
    assert len(with_prompt) > len(without)


def _post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def test_http_chat_honours_add_generation_prompt_and_kwargs(model_dir):
    from ember_cupy.config import EngineConfig
    from ember_cupy.engine.llm_engine import LLMEngine
    from ember_cupy.server import AsyncEngine, BackgroundServer, EngineMetrics, ServerSettings
    engine = LLMEngine(model_dir, EngineConfig(num_kv_blocks=64, block_size=4))
    settings = ServerSettings(host="127.0.0.1", port=0, served_model_names=["tiny"])
    server = BackgroundServer(AsyncEngine(engine, metrics=EngineMetrics("tiny")), settings).start()
    try:
        count = lambda **extra: _post(server.url + "/v1/chat/completions",  # noqa: E731
                                      {"messages": MESSAGES, "max_tokens": 1, **extra})["usage"]["prompt_tokens"]
        encode = lambda **kw: len(engine.tokenizer.encode(  # noqa: E731
            engine.tokenizer.apply_chat_template(MESSAGES, **kw), add_special_tokens=False))
        assert count() == encode()
        assert count(add_generation_prompt=False) == encode(add_generation_prompt=False) < count()
        assert count(chat_template_kwargs={"enable_thinking": False}) == encode(enable_thinking=False) > count()
    finally:
        server.stop()
