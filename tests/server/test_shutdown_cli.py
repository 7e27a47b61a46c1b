"""`ember-cupy serve` as a real process: env-var flags, graceful SIGTERM / SIGINT; CLI parsing."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from server_helpers import free_port, http

from ember_cupy import cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spawn(port: int, *flags: str, **env) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   "EMBER_BACKEND": "numpy", "EMBER_PORT": str(port), "EMBER_KV_CACHE_MEMORY": "24MiB",
                   "EMBER_NO_PROGRESS": "1", **env}
    return subprocess.Popen([sys.executable, "-m", "ember_cupy.cli", "serve", *flags], env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if http(f"http://127.0.0.1:{port}", "GET", "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")


def test_graceful_shutdown_sigterm_and_sigint():
    port_a, port_b = free_port(), free_port()
    # 2000 tokens take seconds even on a fast machine (300 once finished within the 1 s drain on CI)
    a = _spawn(port_a, "--drain-timeout", "1", "--served-model-name", "tiny", EMBER_KV_CACHE_MEMORY="64MiB")
    b = _spawn(port_b)
    try:
        _wait_healthy(a, port_a)
        _wait_healthy(b, port_b)
        _, _, raw = http(f"http://127.0.0.1:{port_a}", "GET", "/v1/models")
        assert [m["id"] for m in json.loads(raw)["data"]] == ["tiny"]
        # A: a long stream in flight when SIGTERM arrives is aborted after the drain timeout
        events: list[str] = []
        request = urllib.request.Request(
            f"http://127.0.0.1:{port_a}/v1/completions", method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"prompt": "Once", "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode())
        first = threading.Event()

        def read():
            with urllib.request.urlopen(request, timeout=60) as response:
                for line in response:
                    if line.startswith(b"data: "):
                        events.append(line[6:].decode().strip())
                        first.set()
        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(60)
        a.send_signal(signal.SIGTERM)
        b.send_signal(signal.SIGINT)
        assert a.wait(60) == 0 and b.wait(60) == 0
        reader.join(10)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        out_a = a.stdout.read()
        assert "shutting down" in out_a and "stopped" in out_a
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_env_vars_and_flags(monkeypatch):
    monkeypatch.setenv("EMBER_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("EMBER_API_KEY", "k")
    monkeypatch.setenv("EMBER_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("EMBER_KV_CACHE_MEMORY", "256MiB")
    monkeypatch.setenv("EMBER_ALLOWED_ORIGINS", "http://a.example,http://b.example")
    args = cli.build_parser().parse_args(["serve", "--max-num-batched-tokens", "99"])
    assert args.max_num_seqs == 7 and args.api_key == "k" and args.enable_prefix_caching is False
    assert args.kv_cache_memory == 256 << 20 and args.max_num_batched_tokens == 99
    assert args.allowed_origins == ["http://a.example", "http://b.example"]
    assert args.host == "127.0.0.1" and args.port == 8000
    args = cli.build_parser().parse_args(["serve", "--max-num-seqs", "3", "--enable-prefix-caching"])
    assert args.max_num_seqs == 3 and args.enable_prefix_caching is True   # the flag wins
    config = cli.engine_config(args)
    assert config.max_num_seqs == 3 and config.kv_cache_memory == 256 << 20
    monkeypatch.setenv("EMBER_MAX_NUM_SEQS", "many")
    with pytest.raises(SystemExit):
        cli.build_parser()


@pytest.mark.parametrize("text,expected", [("1024", 1024), ("512MiB", 512 << 20), ("2G", 2 << 30),
                                           ("1.5k", 1536), ("3 GB", 3 << 30)])
def test_parse_size(text, expected):
    assert cli.parse_size(text) == expected


def test_parse_size_rejects():
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_size("lots")


def test_served_names():
    parse = cli.build_parser().parse_args
    assert cli.served_names(parse(["serve"])) == ["SmolLM2-135M-Instruct"]
    assert cli.served_names(parse(["serve", "--model", "/m/Foo.Q4.gguf"])) == ["Foo.Q4"]
    assert cli.served_names(parse(["serve", "--served-model-name", "a", "b"])) == ["a", "b"]


def test_progress_bar(capsys):
    import io
    stream = io.StringIO()
    bar = cli.ProgressBar(stream=stream)
    for done in range(11):
        bar(done, 10)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("Loading model [") and "100%" in lines[-1] and len(lines) == 2


def test_generate_command(checkpoint, monkeypatch, capsys):
    monkeypatch.setattr(cli.loading, "load_engine", lambda args: __import__(
        "ember_cupy.engine.llm_engine", fromlist=["LLMEngine"]).LLMEngine(checkpoint, cli.engine_config(args)))
    assert cli.main(["generate", "The capital of France is", "--max-tokens", "4", "--temperature", "0",
                     "--num-kv-blocks", "16"]) == 0
    out = capsys.readouterr()
    assert "Paris" in out.out and "tokens in" in out.err


def test_bad_engine_flag_is_an_error(capsys):
    assert cli.main(["serve", "--max-num-seqs", "0", "--port", "1"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
