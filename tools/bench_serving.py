"""Serving benchmark for any OpenAI-compatible server (ember-cupy, llama.cpp's llama-server, vLLM).

Streams `/v1/completions` with `ignore_eos` and a fixed `max_tokens`, so every server generates the
same number of tokens; closed loop at `--concurrency` C, or Poisson / gamma arrivals at
`--request-rate` R (with C as a cap). Reports output tok/s, request/s and TTFT / TPOT / ITL / E2E
percentiles as a table and as JSON (`--out`). Dependencies: the standard library and aiohttp.

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 --concurrency 16 --num-requests 64

Prompts are seeded random sequences of common English words that are one token each (with their
leading space) in SmolLM2's / GPT-2-style BPE vocabularies, so a prompt of L words is about L tokens
for every server on the same GGUF. TPOT = (E2E - TTFT) / (output_tokens - 1); ITL = the gaps between
streamed chunks (one token per chunk on llama-server; ember-cupy may merge a held-back partial UTF-8
token into the next chunk).

Sampling: greedy (temperature 0) by default; --temperature / --top-p / --top-k / --min-p go in the
request body (top_k and min_p are extra fields that llama-server and ember-cupy both accept).
Each request gets its own TCP connection unless --keep-alive: reusing a keep-alive connection that
the server has just closed fails the request on the client side ("Can not write request body",
"Server disconnected"), which is a client artefact, not a server failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp

WORDS = tuple("""the of and to in is was for on that with as by at from his it an were are which this
be or has had but not first one their its new after who they have her she he been two time more
other all would there year over city world when during some people into school also may most many
these years state three then between under work known part later than while where both those being
before such through about house water light river music small great family group early game area
power found life second team high long since public named north south east west number war land own
end field line order form book film story name place town road church point home sea air body art
day night way side head hand eye word king fire stone tree ship door wall bridge garden market island
forest mountain valley village station street summer winter morning evening""".split())

PERCENTILES = (50, 90, 99)


# ---------------------------------------------------------------- workload (pure, seeded)

def make_prompts(num: int, len_min: int, len_max: int, shared_prefix_len: int = 0,
                 seed: int = 0) -> list[str]:
    """`num` prompts of len_min..len_max words (uniform), after a shared prefix of
    `shared_prefix_len` words common to all of them (a system prompt)."""
    rng = random.Random(seed)
    prefix = [random.Random(seed - 1).choice(WORDS) for _ in range(shared_prefix_len)]
    prompts = []
    for _ in range(num):
        length = rng.randint(len_min, len_max)
        prompts.append(" ".join(prefix + [rng.choice(WORDS) for _ in range(length)]))
    return prompts


def load_jsonl(path: str) -> list[dict]:
    """Lines of {"prompt": str, "max_tokens": int (optional)}."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def arrival_offsets(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from start): gamma-distributed gaps with mean 1/rate; burstiness 1 is a
    Poisson process, < 1 burstier, > 1 more regular. rate = inf: all at once (closed loop)."""
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    rng = random.Random(seed + 1_000_003)
    shape, scale = burstiness, 1.0 / (rate * burstiness)
    t, offsets = 0.0, []
    for _ in range(num):
        offsets.append(t)
        t += rng.gammavariate(shape, scale)
    return offsets


# ---------------------------------------------------------------- metrics (pure)

@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    start: float = 0.0                     # perf_counter when sent
    ttft: float | None = None              # s to the first chunk with text
    latency: float | None = None           # s to the end of the stream (E2E)
    itl: list[float] = field(default_factory=list)   # gaps between text chunks
    chunks: int = 0                        # chunks with text
    output_tokens: int = 0                 # usage.completion_tokens, else chunks
    prompt_tokens: int | None = None       # usage.prompt_tokens when the server sends it
    index: int = -1                        # position in the payload list


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float], scale: float = 1000.0) -> dict:
    """mean and percentiles of `values` times `scale` (s -> ms by default)."""
    out = {"mean": sum(values) / len(values) * scale if values else None}
    for q in PERCENTILES:
        p = percentile(values, q)
        out[f"p{q}"] = None if p is None else p * scale
    return out


def tpot(r: RequestResult) -> float | None:
    """Time per output token after the first; None with fewer than 2 tokens."""
    if r.latency is None or r.ttft is None or r.output_tokens < 2:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    tpots = [t for t in map(tpot, ok) if t is not None]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(prompt_tokens) if prompt_tokens else None,
        "output_tok_per_s": out_tokens / duration if duration > 0 else 0.0,
        "request_per_s": len(ok) / duration if duration > 0 else 0.0,
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution([g for r in ok for g in r.itl]),
        "e2e_ms": distribution([r.latency for r in ok if r.latency is not None]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "error_counts": error_counts(results),
        "failures": [{"index": r.index, "error": r.error,
                      "after_s": None if r.latency is None else round(r.latency, 3)}
                     for r in results if not r.ok][:MAX_FAILURES_KEPT],
    }


MAX_FAILURES_KEPT = 20


def error_counts(results: list[RequestResult]) -> dict[str, int]:
    """How many requests failed with each error text, most frequent first."""
    counts: dict[str, int] = {}
    for r in results:
        if not r.ok:
            counts[r.error or "unknown error"] = counts.get(r.error or "unknown error", 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def format_table(s: dict) -> str:
    lines = [f"{'requests ok / failed':<24}{s['completed']} / {s['failed']}",
             f"{'duration (s)':<24}{s['duration_s']:.2f}",
             f"{'output tokens':<24}{s['total_output_tokens']}",
             f"{'output tok/s':<24}{s['output_tok_per_s']:.2f}",
             f"{'request/s':<24}{s['request_per_s']:.3f}",
             f"{'(ms)':<10}" + "".join(f"{k:>10}" for k in ("mean", *(f"p{q}" for q in PERCENTILES)))]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        row = s[key]
        cells = "".join(f"{row[k]:>10.2f}" if row[k] is not None else f"{'-':>10}"
                        for k in ("mean", *(f"p{q}" for q in PERCENTILES)))
        lines.append(f"{key[:-3].upper():<10}{cells}")
    for err, n in (s.get("error_counts") or {e: 1 for e in s["errors"]}).items():
        lines.append(f"error ({n}x): {err}")
    return "\n".join(lines)


# ---------------------------------------------------------------- client

def parse_sse_line(line: bytes):
    """One SSE line -> a JSON object, "DONE", or None (blank, comment or other field)."""
    text = line.decode("utf-8", "replace").strip()
    if not text.startswith("data:"):
        return None
    data = text[5:].strip()
    return "DONE" if data == "[DONE]" else json.loads(data)


def _apply_event(r: RequestResult, event: dict, now: float, last: list) -> None:
    if "error" in event:
        raise RuntimeError(f"stream error: {event['error']}")
    usage = event.get("usage") or {}
    if usage.get("completion_tokens") is not None:
        r.output_tokens = usage["completion_tokens"]
        r.prompt_tokens = usage.get("prompt_tokens")
    text = "".join(c.get("text") or "" for c in event.get("choices") or [])
    if not text:
        return
    if r.ttft is None:
        r.ttft = now - r.start
    else:
        r.itl.append(now - last[0])
    last[0] = now
    r.chunks += 1


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict) -> RequestResult:
    """POST a streaming completion; time its chunks. Never raises: failures set ok=False."""
    r = RequestResult(start=time.perf_counter())
    last, done = [r.start], False
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                r.latency = time.perf_counter() - r.start
                return r
            async for line in resp.content:
                event = parse_sse_line(line)
                if event == "DONE":
                    done = True
                    break
                if event is not None:
                    _apply_event(r, event, time.perf_counter(), last)
        r.latency = time.perf_counter() - r.start
        if r.output_tokens == 0:
            r.output_tokens = r.chunks
        r.ok = done and r.ttft is not None
        r.error = "" if r.ok else "stream ended without text or [DONE]"
    except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as exc:
        r.latency = time.perf_counter() - r.start
        stage = "before the first token" if r.ttft is None else f"after {r.chunks} chunks"
        r.error = f"{type(exc).__name__} {stage}: {exc}"[:300]
    return r


def sampling_body(temperature: float = 0.0, top_p: float | None = None, top_k: int | None = None,
                  min_p: float | None = None) -> dict:
    """Sampling fields of a request body; the ones left None are not sent (server defaults).
    top_k / min_p are not OpenAI fields: llama-server and ember-cupy (like vLLM) accept them."""
    body = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}
    return {k: v for k, v in body.items() if v is not None}


def build_payload(model: str, prompt: str, max_tokens: int, temperature: float = 0.0,
                  extra: dict | None = None, sampling: dict | None = None) -> dict:
    """A streaming completion that generates exactly `max_tokens` tokens (ignore_eos).
    `sampling` (see sampling_body) replaces `temperature`; `extra` is merged last."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            **(sampling if sampling is not None else {"temperature": temperature}),
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **(extra or {})}


async def run_benchmark(base_url: str, payloads: list[dict], concurrency: int = 1,
                        request_rate: float = math.inf, burstiness: float = 1.0,
                        max_seconds: float = math.inf, seed: int = 0,
                        timeout: float = 600.0,
                        keep_alive: bool = False) -> tuple[list[RequestResult], float]:
    """Send `payloads` at their arrival times, at most `concurrency` in flight; stop sending new
    ones after `max_seconds` (in-flight requests finish). Returns (results, wall duration).
    keep_alive=False: a new TCP connection per request (see the module docstring)."""
    url = base_url.rstrip("/") + "/v1/completions"
    offsets = arrival_offsets(len(payloads), request_rate, burstiness, seed)
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0, force_close=not keep_alive)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
        async def one(index, payload):
            try:
                result = await send_request(session, url, payload)
                result.index = index
                return result
            finally:
                gate.release()

        start, tasks = time.perf_counter(), []
        for index, (payload, offset) in enumerate(zip(payloads, offsets)):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await gate.acquire()
            if time.perf_counter() - start > max_seconds:
                gate.release()
                break
            tasks.append(asyncio.create_task(one(index, payload)))
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - start


async def served_model(base_url: str) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(base_url.rstrip("/") + "/v1/models") as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]


# ---------------------------------------------------------------- CLI

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-seconds", type=float, default=math.inf, help="stop sending after this")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight at most")
    ap.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf: closed loop")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    ap.add_argument("--prompt-len-min", type=int, default=32, help="words (about tokens)")
    ap.add_argument("--prompt-len-max", type=int, default=512)
    ap.add_argument("--shared-prefix-len", type=int, default=0, help="words shared by all prompts")
    ap.add_argument("--prompts-jsonl", default=None, help='lines of {"prompt": ..., "max_tokens": ...}')
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=None, help="sent only when given")
    ap.add_argument("--top-k", type=int, default=None, help="sent only when given (extra field)")
    ap.add_argument("--min-p", type=float, default=None, help="sent only when given (extra field)")
    ap.add_argument("--keep-alive", action="store_true",
                    help="reuse connections (default: one TCP connection per request)")
    ap.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    ap.add_argument("--save-requests", action="store_true", help="per-request results in --out")
    return ap.parse_args(argv)


def workload_payloads(args, model: str) -> list[dict]:
    sampling = sampling_body(args.temperature, args.top_p, args.top_k, args.min_p)
    if args.prompts_jsonl:
        rows = load_jsonl(args.prompts_jsonl)[:args.num_requests]
        return [build_payload(model, row["prompt"], row.get("max_tokens", args.max_tokens),
                              extra=args.extra_body, sampling=sampling) for row in rows]
    prompts = make_prompts(args.num_requests, args.prompt_len_min, args.prompt_len_max,
                           args.shared_prefix_len, args.seed)
    return [build_payload(model, p, args.max_tokens, extra=args.extra_body, sampling=sampling)
            for p in prompts]


async def bench(args) -> dict:
    model = args.model or await served_model(args.base_url)
    payloads = workload_payloads(args, model)
    results, duration = await run_benchmark(args.base_url, payloads, args.concurrency,
                                            args.request_rate, args.burstiness, args.max_seconds,
                                            args.seed, args.timeout, args.keep_alive)
    summary = summarize(results, duration)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "save_requests")}
    summary["config"] = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                         for k, v in config.items()} | {"model": model}
    if args.save_requests:
        summary["requests"] = [asdict(r) for r in results]
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    summary = asyncio.run(bench(args))
    print(format_table(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
