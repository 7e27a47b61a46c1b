"""llama-server command lines paste: its flags parse onto ours (-m, -c, -np, --alias, -b, -s, -t,
-ctk / -ctv, the sampling defaults) or are accepted with no effect (-ngl, -fa, --jinja...), a real
`ember-cupy serve` started with llama-server's flags answers as they say, and the values that
cannot hold exit 2 saying why."""
from __future__ import annotations

import json
import os
import shlex
import signal

import pytest
from server_helpers import free_port, http
from test_shutdown_cli import _spawn, _wait_healthy

from ember_cupy import cli
from ember_cupy.cli.serve import check_serve_args
from ember_cupy.model.loader import default_model_path

# llama.cpp's server README and the command lines its users share
LINES = [
    "./llama-server -m models/7B/ggml-model.gguf -c 2048",
    "llama-server -m model.gguf --host 0.0.0.0 --port 8080 -c 4096 -ngl 99 -fa on --jinja -np 4",
    "llama-server -m model.gguf --alias my-model,assistant --api-key secret -t 2 -b 512 -ub 512 --metrics",
    "llama-server -m model.gguf --temp 0.7 --top-k 40 --top-p 0.9 --min-p 0.05 --repeat-penalty 1.1 -n 256 "
    "-ctk f16 -ctv f16 --no-mmap --mlock -cb --no-webui --embeddings --slots -s 42 -to 60",
]


def _pasted(line: str) -> list[str]:
    words = shlex.split(line)[1:]
    words[words.index("-m") + 1] = default_model_path()
    if "--port" not in words:
        words += ["--port", str(free_port())]
    else:
        words[words.index("--port") + 1] = str(free_port())
    return ["serve", *words]


@pytest.mark.parametrize("line", LINES)
def test_llama_server_command_lines_paste(line, monkeypatch):
    monkeypatch.delenv("EMBER_NUM_THREADS", raising=False)
    args = cli.build_parser().parse_args(_pasted(line))
    check_serve_args(args)
    config, settings = cli.engine_config(args), cli.server_settings(args)
    assert config.max_model_len == {"-c 2048": 2048, "-c 4096": 4096}.get(
        next((w for w in ("-c 2048", "-c 4096") if w in line), None))
    if "-np 4" in line:
        assert config.max_num_seqs == 4 and settings.host == "0.0.0.0"
    if "--alias" in line:
        assert settings.served_model_names == ["my-model", "assistant"] and settings.api_key == "secret"
        assert config.max_num_batched_tokens == 512 and os.environ["EMBER_NUM_THREADS"] == "2"
    if "--temp" in line:
        assert config.override_generation_config == {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05,
                                                     "repetition_penalty": 1.1, "max_new_tokens": 256}
        assert config.kv_cache_dtype == "float16" and config.seed == 42 and settings.read_timeout == 60


def test_flags_left_out_keep_our_defaults_and_env():
    args = cli.build_parser().parse_args(["serve", "--port", str(free_port())])
    check_serve_args(args)
    config = cli.engine_config(args)
    assert (config.max_model_len, config.max_num_seqs, config.override_generation_config) == (None, 64, None)
    assert cli.build_parser().parse_args(["serve", "-tp", "1"]).tensor_parallel_size == 1   # not -t p


@pytest.mark.parametrize("flags, message", [
    (["-ctk", "f16", "-ctv", "f32"], "stored alike"),
    (["-ctk", "q8_0"], "invalid choice"),
    (["-c", "-5"], "must be >= 0"),
    (["-fa", "maybe"], "invalid choice"),
    (["--rope-scaling", "yarn"], "unrecognized arguments"),
])
def test_flags_that_cannot_hold_exit_2_saying_why(flags, message, capsys):
    try:
        code = cli.main(["serve", "--port", str(free_port()), *flags])
    except SystemExit as exc:   # argparse's own refusals
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_server_started_with_llama_servers_flags_answers_as_they_say():
    port = free_port()
    proc = _spawn(port, "-m", default_model_path(), "-c", "512", "-np", "2", "--alias", "smol", "--temp", "0",
                  "-n", "3", "-ngl", "99", "-fa", "auto", "--jinja")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, port)
        props = json.loads(http(url, "GET", "/props")[2])
        assert (props["default_generation_settings"]["n_ctx"], props["total_slots"], props["model_alias"]) == \
            (512, 2, "smol")
        ask = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}]}
        first, again = (json.loads(http(url, "POST", "/v1/chat/completions", ask)[2]) for _ in range(2))
        assert first["usage"]["completion_tokens"] == 3          # -n 3: the default max_tokens
        assert first["choices"][0]["message"] == again["choices"][0]["message"]   # --temp 0: greedy
        params = props["default_generation_settings"]["params"]
        assert (params["temperature"], params["n_predict"], params["top_k"]) == (0, 3, 40)   # 40: llama-server's
        native = [json.loads(http(url, "POST", "/completion", {"prompt": "Hello"})[2]) for _ in range(2)]
        assert [r["tokens_predicted"] for r in native] == [3, 3] and native[0]["content"] == native[1]["content"]
        assert json.loads(http(url, "POST", "/completion", {"prompt": "Hello", "n_predict": 5})[2])[
            "tokens_predicted"] == 5
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
