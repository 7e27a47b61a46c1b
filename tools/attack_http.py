"""Resource attacks on the HTTP server: the request shapes that once cost minutes or hundreds of
megabytes (issue 24), each at a base size and grown 10x, sent while a small chat request (1
token) is timed over and over beside them. For each attack it reports

- crashes: a 5xx (a 503 with Retry-After is load shedding, not a crash), a dropped connection, a
  hang (no answer within --timeout), an error body not in OpenAI's shape, /health not ready after;
- the server's resident memory growth per request (VmRSS; a spawned server, or --server-pid);
- the p50 / p99 latency of the concurrent small request, beside an idle baseline: the request is
  sent by a process of its own (so the attack's client, parsing megabytes of JSON in this
  process, never holds up its timing) and each attack is sent again, in fresh rounds, until at
  least --min-probes small requests ran beside it (a p99 of 5 samples is their maximum);
- silent constraint breaks: a structured output that finished with finish_reason "stop" (status
  "completed" on /v1/responses) whose JSON does not match its schema.

Attacks: structured outputs (wide, enum-heavy, deep and slow-to-compile schemas, at once),
Responses (metadata at and past OpenAI's bounds, large stored text.format, previous_response_id
chains), embeddings (64 inputs of growing length), prompt logprobs (prompt_logprobs 20 with n=2
and echo), tokenization (4 large /tokenize bodies at once), llama-server's /completion (64 prompts
with n_probs 20, a wide json_schema).

    python tools/attack_http.py --report attack.json                # spawns a server, ~5 min
    python tools/attack_http.py --quick --min-probes 1 --report attack.json   # a small one, ~1 min
    python tools/attack_http.py --url http://127.0.0.1:8000 --server-pid 1234
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import shlex
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jsonschema
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_shapes import error_body_problem  # noqa: E402
from server_under_test import add_server_arguments, served, served_model, wait_idle  # noqa: E402

DEFAULT_SERVER_ARGS = "--max-model-len 1100 --kv-cache-memory 256MiB"
GROWTH = (1, 10)            # each attack at its base size, then 10x
PROBE_INTERVAL = 0.2        # seconds between two small requests
MAX_ROUNDS = 20             # rounds of one attack at most, whatever --min-probes asks


@dataclass
class Sizes:
    """The base size of each attack; `--quick` shrinks them to fit a small test server."""
    embedding_inputs: int = 64
    embedding_tokens: int = 100          # x10: 64 inputs of 1,000 tokens
    logprob_prompts: int = 64
    logprob_tokens: int = 39             # x10: 64 prompts of 390 tokens
    stored_responses: int = 30
    format_chars: int = 6_000            # text.format description kept with each stored response
    schema_width: int = 20               # properties of the wide schema
    schema_depth: int = 4                # nesting of the deep schema
    slow_schemas: int = 24               # distinct schemas sent at once
    tokenize_chars: int = 400_000        # x10: 4 MB, in each of 4 /tokenize bodies


QUICK = Sizes(embedding_inputs=8, embedding_tokens=20, logprob_prompts=4, logprob_tokens=10, stored_responses=6,
              format_chars=2_000, schema_width=4, schema_depth=2, slow_schemas=6, tokenize_chars=10_000)


# ---------------------------------------------------------------- talking to the server

@dataclass
class Reply:
    status: int | None
    body: dict | None = None
    problem: str | None = None           # a crash: no answer, a 5xx, an error not in OpenAI's shape
    seconds: float = 0.0


def send(session: requests.Session, url: str, path: str, body: dict, timeout: float,
         method: str = "POST") -> Reply:
    start = time.monotonic()
    try:
        response = session.request(method, url + path, json=body if method == "POST" else None, timeout=timeout)
    except requests.Timeout:
        return Reply(None, problem=f"{path}: no answer within {timeout:g} s", seconds=time.monotonic() - start)
    except requests.RequestException as exc:
        return Reply(None, problem=f"{path}: connection failed: {type(exc).__name__}",
                     seconds=time.monotonic() - start)
    return _reply(path, response, time.monotonic() - start)


def _reply(path: str, response: requests.Response, seconds: float) -> Reply:
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = None
    problem = None
    if status >= 500 and not (status == 503 and "Retry-After" in response.headers):
        problem = f"{path}: {status} {response.text[:200]}"
    elif status >= 400:
        shape = error_body_problem(response.content)
        problem = f"{path}: {status} {shape}" if shape else None
    return Reply(status, body, problem, seconds)


def resident_bytes(pid: int | None) -> int | None:
    """VmRSS of a process (Linux), None when unknown."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Probe:
    """A small chat request (1 token), sent every PROBE_INTERVAL seconds by a process of its own:
    its latencies while an attack runs (`latencies`, `problems`: what has come back so far)."""

    def __init__(self, url: str, model: str, timeout: float):
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._results = context.Queue()
        self._process = context.Process(target=_probe_loop, args=(url, model, timeout, self._stop, self._results),
                                        daemon=True)
        self.latencies: list[float] = []
        self.problems: list[str] = []

    def __enter__(self) -> Probe:
        self._process.start()
        self._receive(block=True, timeout=60)   # its first answer: the process is up
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._process.join(timeout=600)
        self._receive()

    def count(self) -> int:
        """Small requests answered so far."""
        self._receive()
        return len(self.latencies)

    def _receive(self, block: bool = False, timeout: float | None = None) -> None:
        while True:
            try:
                kind, value = self._results.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            block = False
            if kind == "latency":
                self.latencies.append(value)
            elif kind == "problem":
                self.problems.append(value)


def _probe_loop(url: str, model: str, timeout: float, stop, results) -> None:
    session = requests.Session()
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    while not stop.is_set():
        reply = send(session, url, "/v1/chat/completions", body, timeout)
        if reply.status == 200:
            results.put(("latency", reply.seconds))
        elif reply.problem:
            results.put(("problem", f"small request: {reply.problem}"))
        else:
            results.put(("other", reply.status))
        stop.wait(PROBE_INTERVAL)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


# ---------------------------------------------------------------- the attacks

@dataclass
class Request:
    path: str
    body: dict
    schema: dict | None = None           # the JSON schema its output must match
    method: str = "POST"


def token_ids(count: int, salt: int) -> list[int]:
    return [1000 + (salt * 7919 + i) % 20000 for i in range(count)]


def embeddings(model: str, sizes: Sizes, growth: int, round_no: int = 0) -> list[Request]:
    salt = round_no * sizes.embedding_inputs      # fresh ids each round: the prefix cache misses
    inputs = [token_ids(sizes.embedding_tokens * growth, salt + i) for i in range(sizes.embedding_inputs)]
    return [Request("/v1/embeddings", {"model": model, "input": inputs})]


def prompt_logprobs(model: str, sizes: Sizes, growth: int, round_no: int = 0) -> list[Request]:
    salt = round_no * sizes.logprob_prompts
    prompts = [token_ids(sizes.logprob_tokens * growth, salt + i) for i in range(sizes.logprob_prompts)]
    base = {"model": model, "prompt": prompts, "max_tokens": 1, "prompt_logprobs": 20}
    return [Request("/v1/completions", base),
            Request("/v1/completions", {**base, "n": 2, "echo": True, "logprobs": 20})]


def tokenize(model: str, sizes: Sizes, growth: int, round_no: int = 0) -> list[Request]:
    text = "lorem ipsum dolor " * (sizes.tokenize_chars * growth // 18)
    return [Request("/tokenize", {"model": model, "prompt": text}) for _ in range(4)]


def _wide_schema(width: int, salt: int) -> dict:
    properties = {f"f{salt}_{i}": {"type": "integer", "minimum": 0, "maximum": 9} for i in range(width)}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _enum_schema(count: int, salt: int) -> dict:
    return {"type": "object", "properties": {"pick": {"enum": [f"v{salt}_{i}" for i in range(count)]}},
            "required": ["pick"], "additionalProperties": False}


def _deep_schema(depth: int, salt: int) -> dict:
    schema: dict = {"type": "integer", "minimum": salt % 5}
    for level in range(depth):
        schema = {"type": "object", "properties": {f"n{level}": schema}, "required": [f"n{level}"],
                  "additionalProperties": False}
    return schema


def _slow_schema(width: int, salt: int) -> dict:
    """Strings with length bounds and patterns: many states for the grammar compiler."""
    properties = {f"s{salt}_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 3 + 1},{i % 7 + 20}}}$",
                                   "minLength": 1, "maxLength": 40} for i in range(width)}
    return {"type": "object", "properties": properties, "required": list(properties)[:2]}


def _structured_chat(model: str, schema: dict) -> Request:
    return Request("/v1/chat/completions", {
        "model": model, "max_tokens": 48, "temperature": 0,
        "messages": [{"role": "user", "content": "Reply with JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}, schema)


def structured(model: str, sizes: Sizes, growth: int, round_no: int = 0) -> list[Request]:
    salt = int(time.monotonic() * 1000) % 100000      # fresh schemas: the compile cache misses
    schemas = [_wide_schema(sizes.schema_width * growth, salt), _enum_schema(50 * growth, salt),
               _deep_schema(sizes.schema_depth * growth, salt)]
    schemas += [_slow_schema(sizes.schema_width * growth, salt + i) for i in range(sizes.slow_schemas)]
    return [_structured_chat(model, schema) for schema in schemas]


def responses(model: str, sizes: Sizes, growth: int, round_no: int = 0) -> list[Request]:
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}      # OpenAI's bounds, all used
    too_much = {f"k{i}": "v" * 600 for i in range(17 * growth)}           # past them: a 400
    answer = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}},
              "required": ["answer"], "additionalProperties": False}
    text = {"format": {"type": "json_schema", "name": "answer", "schema": answer,
                       "description": "d" * (sizes.format_chars * growth)}}
    body = {"model": model, "input": "Give a one-word answer as JSON.", "max_output_tokens": 16,
            "temperature": 0, "metadata": metadata, "text": text, "instructions": "Be brief."}
    stored = [Request("/v1/responses", body, answer) for _ in range(sizes.stored_responses)]
    return stored + [Request("/v1/responses", {**body, "metadata": too_much})]


def llamacpp(model: str, sizes: Sizes, growth: int, round_no: int = 0) -> list[Request]:
    """llama-server's /completion: many prompts with 20 top logprobs per token, and a wide schema."""
    salt = round_no * sizes.logprob_prompts
    prompts = [token_ids(sizes.logprob_tokens * growth, salt + i) for i in range(sizes.logprob_prompts)]
    schema = _wide_schema(sizes.schema_width * growth, int(time.monotonic() * 1000) % 100000)
    return [Request("/completion", {"model": model, "prompt": prompts, "n_predict": 2, "n_probs": 20}),
            Request("/completion", {"model": model, "prompt": "Reply with JSON.", "n_predict": 48, "temperature": 0,
                                    "json_schema": schema}, schema)]


ATTACKS = {"structured": structured, "responses": responses, "embeddings": embeddings,
           "prompt_logprobs": prompt_logprobs, "tokenize": tokenize, "llamacpp": llamacpp}


# ---------------------------------------------------------------- checking the outputs

def structured_text(request: Request, reply: Reply) -> str | None:
    """The JSON text of a structured output that ended normally (None otherwise)."""
    body = reply.body or {}
    if request.path == "/completion":   # llama-server's result: eos = the grammar ended
        return body.get("content") if body.get("stop_type") == "eos" else None
    if request.path == "/v1/responses":
        if body.get("status") != "completed":
            return None
        parts = [p for item in body.get("output", []) if item.get("type") == "message" for p in item["content"]]
        return "".join(p["text"] for p in parts)
    choices = body.get("choices") or [{}]
    if choices[0].get("finish_reason") != "stop":
        return None
    return choices[0]["message"]["content"]


def constraint_break(request: Request, reply: Reply) -> str | None:
    if request.schema is None or reply.status != 200:
        return None
    text = structured_text(request, reply)
    if text is None:
        return None
    try:
        jsonschema.validate(json.loads(text), request.schema)
    except ValueError:
        return f"{request.path}: finished 'stop' with text that is not JSON: {text[:200]!r}"
    except jsonschema.ValidationError as exc:
        return f"{request.path}: finished 'stop' with JSON that breaks its schema ({exc.message[:150]}): {text[:200]!r}"
    return None


# ---------------------------------------------------------------- one attack, the run

@dataclass
class AttackResult:
    name: str
    growth: int
    requests: int
    seconds: float
    statuses: dict[str, int]
    crashes: list[str] = field(default_factory=list)
    constraint_breaks: list[str] = field(default_factory=list)
    rss_growth_bytes_per_request: float | None = None
    small_request_p50_s: float | None = None
    small_request_p99_s: float | None = None
    small_requests: int = 0
    slowest_attack_request_s: float = 0.0
    rounds: int = 1                      # times the attack's batch was sent


def run_attack(name: str, growth: int, server, model: str, sizes: Sizes, args) -> AttackResult:
    rss_before = resident_bytes(args.server_pid or server.pid)
    start = time.monotonic()
    batch: list[Request] = []
    replies: list[Reply] = []
    with Probe(server.url, model, args.timeout) as probe, ThreadPoolExecutor(args.workers) as pool:
        time.sleep(PROBE_INTERVAL)       # the probe has a baseline before the attack lands
        sessions = threading.local()

        def one(request: Request) -> Reply:
            if not hasattr(sessions, "session"):
                sessions.session = requests.Session()
            return send(sessions.session, server.url, request.path, request.body, args.timeout, request.method)

        for round_no in range(MAX_ROUNDS):
            round_batch = ATTACKS[name](model, sizes, growth, round_no)
            replies += pool.map(one, round_batch)
            batch += round_batch
            if probe.count() >= args.min_probes:
                break
    seconds = time.monotonic() - start
    rss_after = resident_bytes(args.server_pid or server.pid)
    return AttackResult(
        name, growth, len(batch), round(seconds, 2), dict(Counter(str(r.status) for r in replies)),
        crashes=[r.problem for r in replies if r.problem] + probe.problems,
        constraint_breaks=[b for b in (constraint_break(q, r) for q, r in zip(batch, replies)) if b],
        rss_growth_bytes_per_request=None if rss_before is None or rss_after is None
        else round((rss_after - rss_before) / len(batch)),
        small_request_p50_s=percentile(probe.latencies, 0.5), small_request_p99_s=percentile(probe.latencies, 0.99),
        small_requests=len(probe.latencies), slowest_attack_request_s=round(max(r.seconds for r in replies), 2),
        rounds=round_no + 1)


def idle_baseline(server, model: str, timeout: float, seconds: float) -> dict:
    with Probe(server.url, model, timeout) as probe:
        time.sleep(seconds)
    return {"small_request_p50_s": percentile(probe.latencies, 0.5),
            "small_request_p99_s": percentile(probe.latencies, 0.99), "small_requests": len(probe.latencies)}


def after_run_problems(server, timeout: float) -> list[str]:
    problems = []
    try:
        health = requests.get(server.url + "/health", timeout=10)
        if health.status_code != 200:
            problems.append(f"/health after the attacks: {health.status_code} {health.text[:200]}")
        gauges = wait_idle(server.url, timeout)
        if not gauges.idle:
            problems.append(f"not idle {timeout:g} s after the attacks: {gauges}")
    except requests.RequestException as exc:
        problems.append(f"the server is gone after the attacks: {type(exc).__name__}")
    return problems + [f"server log: {line}" for line in server.log_errors()[:20]]


def summarize(results: list[AttackResult], baseline: dict, after: list[str]) -> dict:
    return {"baseline": baseline, "attacks": [asdict(r) for r in results],
            "crashes": sum(len(r.crashes) for r in results) + len(after),
            "constraint_breaks": sum(len(r.constraint_breaks) for r in results),
            "after_run_problems": after}


def print_summary(summary: dict) -> None:
    base = summary["baseline"]
    idle_p99 = base["small_request_p99_s"]
    print(f"idle small request: p50 {base['small_request_p50_s']} s, p99 {idle_p99} s "
          f"({base['small_requests']} requests)")
    print(f"{'attack':16s} {'x':>3s} {'rounds':>6s} {'reqs':>4s} {'secs':>7s} {'RSS/req':>11s} {'small':>5s} "
          f"{'p50':>6s} {'p99':>6s} {'/idle':>5s}  statuses")
    for r in summary["attacks"]:
        rss = r["rss_growth_bytes_per_request"]
        rss_text = "?" if rss is None else f"{rss / 1024:.0f} KiB"
        p99 = r["small_request_p99_s"]
        ratio = f"{p99 / idle_p99:.1f}x" if p99 and idle_p99 else "?"
        print(f"{r['name']:16s} {r['growth']:3d} {r['rounds']:6d} {r['requests']:4d} {r['seconds']:7.1f} "
              f"{rss_text:>11s} {r['small_requests']:5d} {str(r['small_request_p50_s']):>6s} {str(p99):>6s} "
              f"{ratio:>5s}  {r['statuses']}")
        for line in r["crashes"][:3] + r["constraint_breaks"][:3]:
            print(f"    - {line[:300]}")
    for line in summary["after_run_problems"]:
        print(f"- {line[:300]}")
    print(f"{summary['crashes']} crashes, {summary['constraint_breaks']} silent constraint breaks")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_arguments(p, DEFAULT_SERVER_ARGS)
    p.add_argument("--quick", action="store_true", help="small shapes (a test server, about a minute)")
    p.add_argument("--attacks", nargs="+", choices=list(ATTACKS), default=list(ATTACKS))
    p.add_argument("--server-pid", type=int, help="the --url server's process, for its resident memory")
    p.add_argument("--workers", type=int, default=8, help="attack requests in flight at once")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a response may take")
    p.add_argument("--baseline-seconds", type=float, default=10.0, help="idle probing before the attacks")
    p.add_argument("--min-probes", type=int, default=40,
                   help=f"send each attack again (at most {MAX_ROUNDS} rounds) until this many small requests ran beside it")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="seconds the engine may take to become idle after the last attack")
    p.add_argument("--report", help="write the summary as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    with served(args.url, shlex.split(args.server_args), args.server_log) as server:
        model = served_model(server.url)
        baseline = idle_baseline(server, model, args.timeout, args.baseline_seconds)
        results = [run_attack(name, growth, server, model, sizes, args) for name in args.attacks for growth in GROWTH]
        after = after_run_problems(server, args.idle_timeout)
    summary = summarize(results, baseline, after)
    print_summary(summary)
    if args.report:
        Path(args.report).write_text(json.dumps(summary, indent=1, ensure_ascii=False))
    return 1 if summary["crashes"] or summary["constraint_breaks"] else 0


if __name__ == "__main__":
    sys.exit(main())
