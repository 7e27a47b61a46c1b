"""Soak test for the HTTP server: rounds of N concurrent streams (completions and chats), a
fraction of them dropped by the client at a random moment (before the response, or after a
random number of chunks) while it has far to go. After each round the engine must be idle with
every KV block free (GET /metrics: running and waiting 0, free KV blocks = total), every stream
that was not dropped must have ended properly (200, well-formed chunks, a finish reason, one
`data: [DONE]`), the finished-requests counter must have grown by at least the streams that
ended, and its "abort" count by at least the streams dropped after their response began. Prints
a summary per round; exits 1 on any failure.

    python tools/soak.py                                    # 200 streams, 30% dropped, 3 rounds
    python tools/soak.py --url http://127.0.0.1:8000 --streams 64 --rounds 5
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_shapes import DONE, error_body_problem, event_problem  # noqa: E402
from server_under_test import add_server_arguments, read_metrics, served, served_model, wait_idle  # noqa: E402

DEFAULT_SERVER_ARGS = "--max-model-len 512 --kv-cache-memory 128MiB"
FINISHED_METRIC = "ember:request_success_total"
# a shared system prompt and a shared opening, so that streams share (and drop) prefix-cached blocks
SYSTEM = "You are a helpful assistant. Answer briefly and precisely."
OPENING = "Here is a list of facts about rivers, mountains and cities of the world. "
TOPICS = ["the Nile", "the Alps", "Tokyo", "the Amazon", "Mount Fuji", "Paris", "the Danube", "Lima"]


# ---------------------------------------------------------------- the workload (seeded)

@dataclass
class Plan:
    path: str
    body: dict
    drop_after_chunks: int | None = None     # close the connection after this many data events
    drop_after_seconds: float | None = None  # or cancel the request this long after sending it


def make_plans(count: int, drop_fraction: float, max_tokens: int, dropped_max_tokens: int, model: str,
               rng: random.Random) -> list[Plan]:
    """`count` streams; the dropped ones ask for `dropped_max_tokens` with ignore_eos, so that
    they are still running when the client leaves, whose abort must then end them."""
    plans = []
    for index in range(count):
        topic = rng.choice(TOPICS)
        body = {"model": model, "stream": True, "max_tokens": rng.randint(max(1, max_tokens // 2), max_tokens),
                "temperature": rng.choice([0.0, 0.8]), "seed": index,
                "n": 2 if rng.random() < 0.1 else 1}
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.5:
            plan = Plan("/v1/completions", {**body, "prompt": f"{OPENING}About {topic}:", "ignore_eos": True})
        else:
            plan = Plan("/v1/chat/completions", {**body, "messages": [
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me about {topic}."}]})
        plans.append(plan)
    for plan in rng.sample(plans, round(count * drop_fraction)):
        if rng.random() < 0.25:
            plan.drop_after_seconds = rng.uniform(0.0, 0.5)
        else:
            plan.drop_after_chunks = rng.randint(0, max(0, plan.body["max_tokens"] - 1))
        plan.body.update(max_tokens=max(dropped_max_tokens, plan.body["max_tokens"]), ignore_eos=True)
    return plans


# ---------------------------------------------------------------- one stream

@dataclass
class StreamResult:
    plan: Plan
    status: int | None = None
    chunks: int = 0
    done: bool = False
    finish_reasons: list = field(default_factory=list)
    dropped_at: str | None = None          # "before the response", "after N chunks"
    shed: bool = False                      # a well-formed 503 with Retry-After (overload)
    problem: str | None = None


async def _read(session: aiohttp.ClientSession, url: str, result: StreamResult) -> None:
    plan = result.plan
    async with session.post(url + plan.path, json=plan.body) as response:
        result.status = response.status
        if response.status != 200:
            raw = await response.read()
            shape = error_body_problem(raw)
            result.shed = response.status == 503 and "Retry-After" in response.headers and not shape
            result.problem = f"HTTP {response.status}: {shape or raw[:300]!r}"
            return
        if plan.drop_after_chunks == 0:
            result.dropped_at = "after 0 chunks"
            response.close()
            return
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip().decode("utf-8", errors="replace")
            problem = event_problem(data)
            if problem or result.done:
                result.problem = problem or f"data after {DONE}"
                return
            if data == DONE:
                result.done = True
                continue
            result.chunks += 1
            for choice in json.loads(data).get("choices", []):
                if choice.get("finish_reason"):
                    result.finish_reasons.append(choice["finish_reason"])
            if plan.drop_after_chunks is not None and result.chunks >= plan.drop_after_chunks:
                result.dropped_at = f"after {result.chunks} chunks"
                response.close()
                return


async def run_stream(session: aiohttp.ClientSession, url: str, plan: Plan) -> StreamResult:
    result = StreamResult(plan)
    try:
        if plan.drop_after_seconds is None:
            await _read(session, url, result)
        else:
            await asyncio.wait_for(_read(session, url, result), plan.drop_after_seconds)
    except asyncio.TimeoutError:
        result.dropped_at = "before the response" if result.status is None else f"after {result.chunks} chunks"
    except aiohttp.ClientError as exc:
        result.problem = f"connection failed: {type(exc).__name__}: {exc}"
    return result


def stream_problem(result: StreamResult, allow_overload: bool = False) -> str | None:
    """What is wrong with a stream: any problem seen, and for one the client did not drop, no
    proper end."""
    if result.shed and allow_overload:
        return None
    if result.problem:
        return result.problem
    if result.dropped_at:
        return None
    if not result.done:
        return f"ended without {DONE}"
    expected = result.plan.body["n"]
    if len(result.finish_reasons) != expected or not all(r in ("stop", "length") for r in result.finish_reasons):
        return f"finish reasons {result.finish_reasons}, expected {expected} of stop/length"
    return None


# ---------------------------------------------------------------- rounds

@dataclass
class RoundReport:
    index: int
    seconds: float
    streams: int
    ended: int
    dropped: Counter
    shed: int
    engine_after: str
    failures: list[str]


async def run_round(url: str, plans: list[Plan], timeout: float, api_key: str | None) -> list[StreamResult]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout, headers=headers) as session:
        return await asyncio.gather(*[run_stream(session, url, plan) for plan in plans])


def soak_round(index: int, url: str, model: str, args, rng: random.Random) -> RoundReport:
    plans = make_plans(args.streams, args.drop_fraction, args.max_tokens, args.dropped_max_tokens, model, rng)
    finished_before = read_metrics(url).get(FINISHED_METRIC, 0.0)
    aborted_before = read_metrics(url, finished_reason="abort").get(FINISHED_METRIC, 0.0)
    start = time.monotonic()
    results = asyncio.run(run_round(url, plans, args.timeout, args.api_key))
    seconds = time.monotonic() - start
    failures = [f"{r.plan.path} {shlex.quote(json.dumps(r.plan.body))[:200]}: {problem}"
                for r in results if (problem := stream_problem(r, args.allow_overload))]
    gauges = wait_idle(url, args.idle_timeout)
    if not gauges.idle:
        failures.append(f"not idle {args.idle_timeout:g} s after the round: {gauges}")
    ended = sum(1 for r in results if r.done and not r.dropped_at)
    finished = read_metrics(url).get(FINISHED_METRIC, 0.0) - finished_before
    if finished < ended:
        failures.append(f"{FINISHED_METRIC} grew by {finished:g}, but {ended} streams ended")
    dropped = Counter(r.dropped_at.split(" ")[0] for r in results if r.dropped_at)
    aborted = read_metrics(url, finished_reason="abort").get(FINISHED_METRIC, 0.0) - aborted_before
    if aborted < dropped["after"]:   # admitted (they got a 200) and far from their max_tokens
        failures.append(f"{dropped['after']} streams dropped after their response began, but {aborted:g} "
                        f"requests finished as aborted (unless the server ran far ahead of this client "
                        f"and finished some first: raise --dropped-max-tokens)")
    shed = sum(r.shed for r in results)
    return RoundReport(index, seconds, len(results), ended, dropped, shed, str(gauges), failures)


def print_round(report: RoundReport) -> None:
    dropped = ", ".join(f"{n} {kind}" for kind, n in sorted(report.dropped.items())) or "none"
    shed = f", {report.shed} refused (503)" if report.shed else ""
    print(f"round {report.index}: {report.streams} streams in {report.seconds:.1f} s, {report.ended} ended{shed}, "
          f"dropped: {dropped}; after: {report.engine_after}; {len(report.failures)} failures", flush=True)
    for failure in report.failures[:10]:
        print(f"  - {failure}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_arguments(p, DEFAULT_SERVER_ARGS)
    p.add_argument("--streams", type=int, default=200, help="concurrent streams per round")
    p.add_argument("--drop-fraction", type=float, default=0.3, help="fraction of streams the client drops")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of a stream: between half this and this")
    p.add_argument("--dropped-max-tokens", type=int, default=200,
                   help="max_tokens (with ignore_eos) of the streams the client drops: more than they "
                        "can generate before the drop; prompt + this must fit the server's context")
    p.add_argument("--allow-overload", action="store_true",
                   help="a 503 with Retry-After is not a failure (for a server run with --max-waiting)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer <key>'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a stream may take")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds the engine may take to become idle after a round")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    failures = 0
    with served(args.url, shlex.split(args.server_args), args.server_log) as server:
        model = served_model(server.url, args.api_key)
        if model is None:
            raise SystemExit("the server wants an API key: give --api-key")
        for index in range(1, args.rounds + 1):
            report = soak_round(index, server.url, model, args, rng)
            print_round(report)
            failures += len(report.failures)
        logged = server.log_errors()
        warnings = server.log_python_warnings()
    for line in logged[:10]:
        print(f"server log: {line}")
    for line in warnings[:5]:
        print(f"(the server printed a Python warning: {line[:300]})")
    failures += len(logged)
    print(f"{'FAILED' if failures else 'passed'}: {args.rounds} rounds of {args.streams} streams, "
          f"{args.drop_fraction:.0%} dropped, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
