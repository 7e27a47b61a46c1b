"""Issue 14 item 7: the `ember-cupy` command as a user meets it, driven as a subprocess."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import ember_cupy
from ember_cupy.model.loader import default_model_path

# compiled host kernels stay in the user's cache when a test moves HOME
KERNEL_CACHE = os.environ.get("EMBER_KERNEL_CACHE", os.path.expanduser("~/.cache/ember_cupy/kernels"))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "EMBER_BACKEND": "numpy", "EMBER_NO_PROGRESS": "1", "EMBER_KERNEL_CACHE": KERNEL_CACHE, **extra}


def _cli(*args: str, stdin: str | None = None, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember_cupy.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=_env(**env))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_version():
    done = _cli("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"ember-cupy {ember_cupy.__version__}"


def test_top_level_help_names_every_command_the_env_variables_and_the_vllm_aliases():
    done = _cli("--help")
    assert done.returncode == 0
    for word in ("serve", "generate", "chat", "info", "--version", "EMBER_", "--scheduling-policy",
                 "--kv-cache-memory-bytes", "--num-gpu-blocks-override", "--gpu-memory-utilization"):
        assert word in done.stdout, word
    for command in ("serve", "generate", "chat", "info"):
        assert _cli(command, "--help").returncode == 0, command


@pytest.mark.parametrize("case", ["port out of range", "missing model", "not a model file", "busy port"])
def test_serve_refuses_bad_setups_with_one_line_and_status_2(case, tmp_path):
    holder = None
    args = ["--port", str(_free_port())]
    if case == "port out of range":
        args = ["--port", "99999"]
    elif case == "missing model":
        args += [str(tmp_path / "nothing-here.gguf")]
    elif case == "not a model file":
        (tmp_path / "notes.txt").write_text("not a model")
        args += [str(tmp_path / "notes.txt")]
    else:
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        args = ["--port", str(holder.getsockname()[1])]
    try:
        start = time.monotonic()
        done = _cli("serve", *args, timeout=60)
        seconds = time.monotonic() - start
    finally:
        if holder is not None:
            holder.close()
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember-cupy: error: "), done.stderr
    assert done.stdout == "" and "listening" not in done.stderr and "Traceback" not in done.stderr
    expected = {"port out of range": "99999", "missing model": "nothing-here.gguf",
                "not a model file": "notes.txt", "busy port": "in use"}[case]
    assert expected in lines[0]
    assert seconds < 30      # refused before any model loads


def _get(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return response.status, response.read()


def test_serve_takes_the_model_positionally_and_vllm_flag_names():
    port = _free_port()
    model = default_model_path()
    proc = subprocess.Popen([sys.executable, "-m", "ember_cupy.cli", "serve", model, "--port", str(port),
                             "--num-gpu-blocks-override", "40", "--scheduling-policy", "priority",
                             "--kv-cache-memory-bytes", "24MiB"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _healthy(proc, port)
        card = json.loads(_get(port, "/v1/models")[1])["data"][0]
        assert card["id"] == "SmolLM2-135M-Instruct.Q4_1" and card["root"] == model
        assert json.loads(_get(port, "/version")[1])["kv_cache_blocks"] == 40
    finally:
        proc.terminate()
        proc.wait(30)


def _chat_on_a_terminal(keys: list[bytes], home: str, timeout: float = 120) -> tuple[str, str, int]:
    """Run `ember-cupy chat` on a pseudo-terminal (readline edits only there), typing each key
    string once the previous prompt is shown; (terminal output, stderr, exit status)."""
    import pty
    import select
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ember_cupy.cli", "chat", "--max-tokens", "2",
                             "--temperature", "0", "--system", "Be brief."],
                            stdin=slave, stdout=slave, stderr=subprocess.PIPE, env=_env(HOME=home))
    os.close(slave)
    screen, deadline = b"", time.monotonic() + timeout
    pending = list(keys)
    try:
        while time.monotonic() < deadline:
            if pending and screen.count(b">>> ") == len(keys) - len(pending) + 1:
                os.write(master, pending.pop(0))
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:     # the child closed the terminal
                    break
                if not chunk:
                    break
                screen += chunk
            elif proc.poll() is not None:
                break
        status = proc.wait(30)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return screen.decode(errors="replace"), proc.stderr.read().decode(), status


def test_chat_edits_lines_keeps_history_and_acknowledges_reset(tmp_path):
    pytest.importorskip("readline")
    left = b"\x1b[D"
    # "Hllo", three steps left, "e": readline makes it "Hello"; then /reset; then Ctrl-D
    screen, stderr, status = _chat_on_a_terminal([b"Hllo" + left * 3 + b"e\r", b"/reset\r", b"\x04"],
                                                 str(tmp_path))
    assert status == 0, stderr
    assert "[conversation reset: the system message is kept]" in stderr
    history = (tmp_path / ".cache" / "ember_cupy" / "chat_history").read_text().splitlines()
    assert history[-2:] == ["Hello", "/reset"]


def test_chat_reads_a_pipe_too():
    done = _cli("chat", "--max-tokens", "2", "--temperature", "0", stdin="Hi\n/reset\n")
    assert done.returncode == 0, done.stderr
    assert "[conversation reset]" in done.stderr


def test_deterministic_flag_its_environment_variable_and_its_validation(monkeypatch):
    from ember_cupy import cli
    from ember_cupy.config import EngineConfig
    monkeypatch.delenv("EMBER_DETERMINISTIC", raising=False)
    parse = lambda *args: cli.engine_config(cli.build_parser().parse_args(["serve", *args]))  # noqa: E731
    assert parse().deterministic is False and parse("--deterministic").deterministic is True
    monkeypatch.setenv("EMBER_DETERMINISTIC", "1")
    assert parse().deterministic is True
    monkeypatch.setenv("EMBER_DETERMINISTIC", "perhaps")
    with pytest.raises(SystemExit, match="EMBER_DETERMINISTIC"):
        parse()
    with pytest.raises(ValueError, match="deterministic must be True or False"):
        EngineConfig(deterministic="yes")
    monkeypatch.delenv("EMBER_DETERMINISTIC")
    help_text = _cli("serve", "--help").stdout
    assert "--deterministic" in help_text and "EMBER_DETERMINISTIC" in help_text


def _healthy(proc, port: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the server did not become healthy"
        try:
            if _get(port, "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)


def _post(port: int, path: str, body: dict):
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_serve_models_dir_routes_each_request_to_its_model_loaded_on_demand(tmp_path):
    for name in ("smol-a", "smol-b"):
        os.symlink(default_model_path(), tmp_path / f"{name}.gguf")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ember_cupy.cli", "serve", "--models-dir", str(tmp_path),
                             "--models-max", "1", "--port", str(port), "--num-kv-blocks", "32"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _healthy(proc, port)
        cards = json.loads(_get(port, "/v1/models")[1])["data"]
        assert {c["id"]: c["status"]["value"] for c in cards} == {"smol-a": "unloaded", "smol-b": "unloaded"}
        chat = {"model": "smol-b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        statuses = []
        for _ in range(300):
            status, body = _post(port, "/v1/chat/completions", chat)
            statuses.append(status)
            if status != 503:
                break
            time.sleep(0.2)
        assert statuses[0] == 503 and statuses[-1] == 200, statuses[-3:]
        assert body["model"] == "smol-b"
        assert _post(port, "/v1/chat/completions", {**chat, "model": "nope"})[0] == 404
        cards = json.loads(_get(port, "/v1/models")[1])["data"]
        assert {c["id"]: c["status"]["value"] for c in cards} == {"smol-a": "unloaded", "smol-b": "loaded"}
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("flags, message", [
    (["--model", "x.gguf"], "give no MODEL"),
    (["--models-max", "0"], "--models-max must be at least 1"),
    (["--data-parallel-backend", "ray"], "cannot be combined"),
])
def test_serve_models_dir_refuses_conflicting_flags_in_one_line(tmp_path, flags, message):
    os.symlink(default_model_path(), tmp_path / "smol.gguf")
    done = _cli("serve", "--models-dir", str(tmp_path), "--port", str(_free_port()), *flags)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_serve_models_dir_without_models_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    done = _cli("serve", "--models-dir", str(tmp_path), "--port", str(_free_port()))
    assert done.returncode == 2 and "holds no .gguf file" in done.stderr, done.stderr


def test_parser_flags_reach_the_server_settings(monkeypatch):
    from ember_cupy import cli
    monkeypatch.setenv("EMBER_TOOL_CALL_PARSER", "llama3_json")
    args = cli.build_parser().parse_args(["serve", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice"])
    settings = cli.server_settings(args)
    assert (settings.reasoning_parser, settings.tool_call_parser) == ("qwen3", "llama3_json")
    assert _cli("serve", "--reasoning-parser", "nope").returncode == 2


def test_serve_a_folder_without_config_json_is_one_line(tmp_path):
    done = _cli("serve", str(tmp_path), "--port", str(_free_port()))
    assert done.returncode == 2 and "has no config.json" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_speculative_config_flag_reaches_the_engine_config_and_a_bad_one_is_one_line(monkeypatch):
    from ember_cupy import cli
    from ember_cupy.speculative_config import SpeculativeConfig
    monkeypatch.delenv("EMBER_SPECULATIVE_CONFIG", raising=False)
    parse = lambda *args: cli.engine_config(cli.build_parser().parse_args(["serve", *args]))  # noqa: E731
    assert parse().speculative_config is None
    flag = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    assert parse("--speculative-config", flag).speculative_config == SpeculativeConfig(4, "ngram", 4, 2)
    done = _cli("serve", "--port", str(_free_port()), "--speculative-config", '{"num_speculative_tokens": 0}')
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "num_speculative_tokens" in done.stderr


def test_a_draft_model_of_another_vocabulary_is_one_line(tmp_path):
    from tiny_model import write_tiny_checkpoint
    write_tiny_checkpoint(tmp_path / "draft")
    flag = json.dumps({"model": str(tmp_path / "draft"), "num_speculative_tokens": 3})
    done = _cli("generate", "--speculative-config", flag, "--max-tokens", "1", "Hello")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "vocabulary has 64 tokens" in done.stderr


_LOAD_STARTS_FIRST = """
import sys
from ember_cupy.cli import serve
from ember_cupy.cli.flags import build_parser
heavy_at_start = []


class RecordedLoad:
    def __init__(self, load):
        heavy_at_start.append(sorted(m for m in ("aiohttp", "pydantic") if m in sys.modules))

    def result(self):
        raise ValueError("no model in this test")


serve.BackgroundLoad = RecordedLoad
try:
    serve.cmd_serve(build_parser().parse_args(["serve", "--port", sys.argv[1], "--log-level", "error"]))
except Exception:
    pass
print("HEAVY_AT_START", heavy_at_start)
"""


def test_serve_starts_loading_the_model_before_the_server_modules_import():
    """The load runs while aiohttp and the protocol's pydantic models import (~0.35 s of a start)."""
    done = subprocess.run([sys.executable, "-c", _LOAD_STARTS_FIRST, str(_free_port())], capture_output=True,
                          text=True, timeout=120, env=_env())
    assert "HEAVY_AT_START [[]]" in done.stdout, (done.stdout, done.stderr[-2000:])


def test_a_background_load_hands_over_its_engine_or_its_error():
    from ember_cupy.cli.loading import BackgroundLoad
    assert BackgroundLoad(lambda: "engine").result() == "engine"

    def fails():
        raise FileNotFoundError("no such model")
    with pytest.raises(FileNotFoundError, match="no such model"):
        BackgroundLoad(fails).result()
