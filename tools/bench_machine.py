"""The machine under a benchmark: whether its CPU is idle, its memory read bandwidth, the server
processes being measured, and their resident memory (tools/bench_vs_llamacpp.py, bench_models.py)."""

import glob
import math
import os
import platform
import re
import shlex
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- CPU idleness

def cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])  # (idle + iowait, total without guest)


def idle_fraction(window: float = 1.0) -> float:
    idle0, total0 = cpu_times()
    time.sleep(window)
    idle1, total1 = cpu_times()
    return (idle1 - idle0) / max(1, total1 - total0)


def wait_for_idle(threshold: float, timeout: float) -> dict:
    """Block until the idle fraction over ~1 s exceeds `threshold`, or `timeout` s pass."""
    start, seen = time.monotonic(), []
    while True:
        seen.append(idle_fraction())
        waited = time.monotonic() - start
        if seen[-1] > threshold or waited >= timeout:
            return {"idle": round(seen[-1], 3), "idle_ok": seen[-1] > threshold,
                    "waited_s": round(waited, 1), "loadavg1": round(os.getloadavg()[0], 2)}


# ---------------------------------------------------------------- memory read bandwidth

def read_bandwidth(size_bytes: int = 2**30, repeats: int = 5, threads: int = 2) -> dict:
    """A STREAM-like read probe: the best of `repeats` NumPy sums over a `size_bytes` float64
    array split among `threads` threads (NumPy releases the GIL in the reduction), in bytes/s."""
    import numpy as np
    data = np.ones(size_bytes // 8)
    parts = np.array_split(data, threads)
    best = math.inf
    for _ in range(repeats):
        workers = [threading.Thread(target=np.sum, args=(part,)) for part in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return {"bytes_per_s": data.nbytes / best, "gb_per_s": round(data.nbytes / best / 1e9, 2),
            "array_bytes": data.nbytes, "repeats": repeats, "threads": threads,
            "method": "best of NumPy float64 sums over threads"}


# ---------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process on a free loopback port; its output goes to a log file."""

    def __init__(self, name: str, argv: list[str], env: dict, port: int, log: Path):
        self.name, self.argv, self.env, self.port, self.log = name, argv, env, port, log
        self.url, self.proc = f"http://127.0.0.1:{port}", None
        self.load_s = None    # seconds from start() to the first healthy /health

    def command(self) -> str:
        """The exact command line, with the environment it adds."""
        extra = " ".join(f"{k}={v}" for k, v in self.env.items())
        return (extra + " " if extra else "") + shlex.join(self.argv)

    def start(self, timeout: float = 600.0) -> "Server":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}:\n"
                                   + self.log.read_text(errors="replace")[-2000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        self.load_s = round(time.monotonic() - started, 2)
                        return self
            except OSError:
                pass
            time.sleep(0.02)   # a load of ~0.5 s is measured to within 4%
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s; see {self.log}")

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def log_lines(self, pattern: str = r"error|exceed|fail|abort|warn", last: int = 12) -> list[str]:
        """The last `last` lines of the server's log that match `pattern` (case-insensitive)."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return []
        rx = re.compile(pattern, re.IGNORECASE)
        return [ln.strip()[:300] for ln in text.splitlines() if rx.search(ln)][-last:]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------- resident memory

def _children(pid: int) -> list[int]:
    """Direct children of `pid`: /proc/<pid>/task/*/children, else a scan of /proc/*/stat."""
    files = glob.glob(f"/proc/{pid}/task/*/children")
    if files:
        kids = []
        for f in files:
            try:
                with open(f) as fh:
                    kids += [int(x) for x in fh.read().split()]
            except OSError:
                pass
        return kids
    kids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.split("/")[2]))
    return kids


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants that are alive now."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in out or not os.path.exists(f"/proc/{p}"):
            continue
        out.append(p)
        todo += _children(p)
    return out


def memory_kb(pid: int) -> dict:
    """VmRSS, VmHWM, RssAnon, RssFile of one process, in kB (absent ones 0; {} if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    out = dict.fromkeys(keys, 0)
    for line in lines:
        key, _, value = line.partition(":")
        if key in keys:
            out[key] = int(value.split()[0])
    return out


class RssSampler:
    """Samples the summed VmRSS of a process tree every `interval` s in a thread, while in a
    `with` block; at the end also reads VmHWM (each process's own peak since it started, summed
    over the tree: an upper bound of the tree's peak). result() -> MB figures."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval = pid, interval
        self.peak_kb = self.peak_anon_kb = self.hwm_kb = self.samples = self.processes = 0
        self._stop, self._thread = threading.Event(), None

    def sample(self) -> None:
        mems = [m for m in map(memory_kb, process_tree(self.pid)) if m]
        if not mems:
            return
        self.samples += 1
        rss = sum(m["VmRSS"] for m in mems)
        if rss > self.peak_kb:
            self.peak_kb, self.peak_anon_kb = rss, sum(m["RssAnon"] for m in mems)
        self.hwm_kb = max(self.hwm_kb, sum(m["VmHWM"] for m in mems))
        self.processes = len(mems)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "RssSampler":
        self.sample()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def result(self) -> dict:
        mb = lambda kb: round(kb / 1024, 1)  # noqa: E731
        return {"peak_rss_mb": mb(self.peak_kb), "peak_anon_mb": mb(self.peak_anon_kb),
                "hwm_mb": mb(self.hwm_kb), "samples": self.samples, "interval_s": self.interval,
                "processes": self.processes}



# ---------------------------------------------------------------- this machine

def machine() -> dict:
    def sh(cmd):
        try:
            return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return ""
    cpu = [ln.split(":", 1)[1].strip() for ln in sh(["lscpu"]).splitlines() if ln.startswith("Model name")]
    mem = [ln.split()[1] for ln in sh(["free", "-h"]).splitlines() if ln.startswith("Mem:")]
    import numpy
    return {"cpu": cpu[0] if cpu else platform.processor(), "nproc": os.cpu_count(),
            "memory": mem[0] if mem else "?", "kernel": platform.release(),
            "python": platform.python_version(), "numpy": numpy.__version__,
            "ember_commit": sh(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
            "ember_dirty": bool(sh(["git", "-C", str(ROOT), "status", "--porcelain", "ember_cupy"]))}
