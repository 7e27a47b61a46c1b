"""vLLM command lines paste (issue 28, item 4): lines from vLLM's documentation parse and pass
serve's checks with the model swapped for a local file; the honoured flags (--seed, --chat-template,
--generation-config / --override-generation-config, --max-logprobs) act through HTTP on the real
model; the refused ones exit 2 with the reason."""
from __future__ import annotations

import json
import shlex

import pytest
from server_helpers import MODEL, free_port, http

from ember_cupy import cli
from ember_cupy.cli.serve import check_serve_args
from ember_cupy.model.loader import default_model_path

TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}:{% endif %}"

# from docs.vllm.ai (quickstart, tool calling, reasoning outputs, engine arguments)
DOC_LINES = [
    "vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123",
    "vllm serve meta-llama/Llama-3.1-8B-Instruct --enable-auto-tool-choice --tool-call-parser llama3_json "
    "--chat-template examples/tool_chat_template_llama3.1_json.jinja",
    "vllm serve HuggingFaceTB/SmolLM3-3B --enable-auto-tool-choice --tool-call-parser=hermes",
    "vllm serve deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --reasoning-parser deepseek_r1",
    "vllm serve Qwen/Qwen2.5-1.5B-Instruct --tensor-parallel-size 1 --trust-remote-code --max-model-len 4096 "
    "--gpu-memory-utilization 0.9 --seed 0 --enforce-eager --disable-log-requests --swap-space 4",
    "vllm serve facebook/opt-125m --generation-config vllm --max-logprobs 5 --disable-log-stats",
    "vllm serve Qwen/Qwen3-8B --override-generation-config '{\"temperature\": 0.6, \"top_p\": 0.95}' "
    "--max-num-seqs 16 --max-num-batched-tokens 2048 --enable-prefix-caching --load-format auto",
]


def _pasted(line: str, tmp_path) -> list[str]:
    """The line's serve arguments, its model a local file, its chat template a file here."""
    template = tmp_path / "tool_chat_template.jinja"
    template.write_text(TEMPLATE)
    words = shlex.split(line)[2:]
    words[0] = default_model_path()
    return ["serve", *[str(template) if w.endswith(".jinja") else w for w in words], "--port", str(free_port())]


@pytest.mark.parametrize("line", DOC_LINES)
def test_vllm_documentation_command_lines_paste(line, tmp_path):
    args = cli.build_parser().parse_args(_pasted(line, tmp_path))
    check_serve_args(args)
    config, settings = cli.engine_config(args), cli.server_settings(args)
    if "--seed 0" in line:
        assert config.seed == 0 and config.max_model_len == 4096
    if "--chat-template" in line:
        assert config.chat_template.endswith(".jinja") and settings.tool_call_parser == "llama3_json"
    if "--max-logprobs 5" in line:
        assert settings.max_logprobs == 5 and config.generation_config == "vllm"
    if "--override-generation-config" in line:
        assert config.override_generation_config == {"temperature": 0.6, "top_p": 0.95}


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel-size", "2"], "--data-parallel-size N"),
    (["-pp", "4"], "runs a model on one device"),
    (["--max-logprobs", "50"], "--max-logprobs must be in 0..20"),
    (["--chat-template", "missing.jinja"], "no such file"),
    (["--tokenizer", "other/tokenizer"], "only the model's own tokenizer"),
])
def test_flags_that_cannot_hold_exit_2_saying_why(flags, message, capsys):
    assert cli.main(["serve", "--port", str(free_port()), *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def configured(start_server):
    return start_server(settings={"max_logprobs": 2}, chat_template=TEMPLATE,
                        override_generation_config={"temperature": 0, "max_new_tokens": 3})


def _post(url, path, body):
    status, _, raw = http(url, "POST", path, body)
    return status, None, json.loads(raw)


def _chat(url, **fields):
    return _post(url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                **fields})


def test_generation_config_defaults_fill_what_a_request_leaves_out(configured):
    status, _, body = _chat(configured.url)
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    status, _, explicit = _chat(configured.url, temperature=0, max_tokens=3)
    assert explicit["choices"][0]["message"] == body["choices"][0]["message"]
    status, _, longer = _chat(configured.url, max_tokens=6, temperature=0)
    assert longer["usage"]["completion_tokens"] > 3 or longer["choices"][0]["finish_reason"] == "stop"


def test_max_logprobs_bounds_a_request(configured):
    assert _chat(configured.url, logprobs=True, top_logprobs=2)[0] == 200
    status, _, body = _chat(configured.url, logprobs=True, top_logprobs=3)
    assert status == 400 and "--max-logprobs" in body["error"]["message"] and body["error"]["param"] == "logprobs"


def test_chat_template_replaces_the_models(configured, server):
    def rendered(url):
        _, _, ids = _post(url, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
        return _post(url, "/detokenize", {"model": MODEL, "tokens": ids["tokens"]})[2]["prompt"]
    assert "<<Hi>>:" in rendered(configured.url)
    assert "<<Hi>>" not in rendered(server.url)    # the shared checkpoint keeps its own template


def test_server_seed_makes_unseeded_sampling_repeat_after_a_restart(start_server):
    def replies(server):
        return [_chat(server.url, temperature=1.0, max_tokens=8)[2]["choices"][0]["message"]["content"]
                for _ in range(3)]
    first, again = replies(start_server(seed=7)), replies(start_server(seed=7))
    assert first == again
    assert replies(start_server(seed=8)) != first
