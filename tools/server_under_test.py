"""The server the HTTP tools (fuzz_http.py, soak.py) test: `ember-cupy serve` spawned on a free
port, or one already running at a URL; and what its /metrics say about the engine (requests
running and waiting, free and total KV blocks) once the load is over."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_LISTENING = re.compile(r"listening on (http://\S+)")
_SAMPLE = re.compile(r"^([\w:]+)(\{[^}]*\})?\s+(\S+)$")
_PYTHON_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class Served:
    url: str
    log_path: Path | None = None      # the spawned server's stdout and stderr; None for --url
    pid: int | None = None            # the spawned server's process; None for --url

    def _log_lines(self) -> list[str]:
        return [] if self.log_path is None else self.log_path.read_text(errors="replace").splitlines()

    def log_errors(self) -> list[str]:
        """ERROR lines and tracebacks the spawned server logged (a handled bad request logs a
        WARNING at most)."""
        return [line for line in self._log_lines() if " ERROR " in line or line.startswith("Traceback")]

    def log_python_warnings(self) -> list[str]:
        """Distinct Python warnings (`file:line: UserWarning: ...`) the spawned server printed:
        worth a look, though a library's deprecation is no failure of the server."""
        lines, found = self._log_lines(), []
        for index, line in enumerate(lines):
            if _PYTHON_WARNING.match(line):
                detail = [more.strip() for more in lines[index + 1:index + 3] if more.startswith(" ")]
                found.append(" | ".join([line, *detail]))
        return list(dict.fromkeys(found))


def _get(url: str, timeout: float = 10, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _wait_listening(proc: subprocess.Popen, log_path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = _LISTENING.search(log_path.read_text(errors="replace"))
        if match:
            return match.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"the server did not start; its log:\n{log_path.read_text(errors='replace')[-4000:]}")


def wait_ready(url: str, timeout: float = 300, proc: subprocess.Popen | None = None) -> None:
    """Until GET /health says 200 (the engine is loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} while loading")
        try:
            if _get(url + "/health", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}/health did not become ready in {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def add_server_arguments(parser, default_server_args: str) -> None:
    """--url, --server-args and --server-log: which server a tool talks to, or how it spawns one."""
    parser.add_argument("--url", help="a running server (default: spawn `ember-cupy serve` with --server-args)")
    parser.add_argument("--server-args", default=default_server_args,
                        help=f"flags for the spawned server (default: {default_server_args!r})")
    parser.add_argument("--server-log", help="where the spawned server logs (default: a temporary file)")


@contextmanager
def served(url: str | None, server_args: list[str], log_path: str | None = None):
    """Yield a Served: the given URL, or `ember-cupy serve <server_args>` on the default model
    (or --model in server_args) spawned on a free loopback port and stopped afterwards."""
    if url:
        url = url.rstrip("/")
        wait_ready(url, timeout=60)
        yield Served(url)
        return
    path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="ember-serve-", suffix=".log")[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "ember_cupy.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--no-progress", *server_args]
    with open(path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        spawned_url = _wait_listening(proc, path, timeout=120)
        wait_ready(spawned_url, proc=proc)
        yield Served(spawned_url, path, proc.pid)
    finally:
        _stop(proc)


def served_model(url: str, api_key: str | None = None) -> str | None:
    """The first served model name (GET /v1/models); None when the server wants an API key
    that was not given."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    status, body = _get(url + "/v1/models", headers=headers)
    if status == 401 and not api_key:
        return None
    if status != 200:
        raise RuntimeError(f"GET /v1/models: {status} {body[:200]!r}")
    return json.loads(body)["data"][0]["id"]


def read_samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of /metrics: (name, labels, value)."""
    status, body = _get(url + "/metrics")
    if status != 200:
        raise RuntimeError(f"GET /metrics: {status}")
    samples = []
    for line in body.decode().splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = dict(_LABEL.findall(match.group(2) or ""))
            samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def read_metrics(url: str, **labels: str) -> dict[str, float]:
    """Each metric's value summed over its samples that carry `labels`."""
    values: dict[str, float] = {}
    for name, got, value in read_samples(url):
        if all(got.get(k) == v for k, v in labels.items()):
            values[name] = values.get(name, 0.0) + value
    return values


@dataclass
class EngineGauges:
    running: float
    waiting: float
    free_blocks: float
    total_blocks: float

    @property
    def idle(self) -> bool:
        """No request left and every KV block free (blocks kept only by the prefix cache are free)."""
        return self.running == 0 and self.waiting == 0 and self.free_blocks == self.total_blocks

    def __str__(self) -> str:
        return (f"running {self.running:g}, waiting {self.waiting:g}, "
                f"free KV blocks {self.free_blocks:g}/{self.total_blocks:g}")


def engine_gauges(url: str) -> EngineGauges:
    m = read_metrics(url)
    return EngineGauges(m["ember:num_requests_running"], m["ember:num_requests_waiting"],
                        m["ember:kv_cache_free_blocks"], m["ember:kv_cache_total_blocks"])


def wait_idle(url: str, timeout: float = 30) -> EngineGauges:
    """The gauges once idle, or the last ones seen after `timeout` seconds (then .idle is False):
    aborts of dropped clients take effect at the next step, so give them a moment."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = engine_gauges(url)
        if gauges.idle or time.monotonic() >= deadline:
            return gauges
        time.sleep(0.2)
