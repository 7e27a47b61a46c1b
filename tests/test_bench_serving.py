"""tools/bench_serving.py: its arithmetic, and its client against a stub SSE server with known
delays. No model, no timing assertions about ember-cupy itself."""
import asyncio
import importlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

_PATH = Path(__file__).resolve().parent.parent / "tools" / "bench_serving.py"
_spec = importlib.util.spec_from_file_location("bench_serving", _PATH)
bs = sys.modules["bench_serving"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bs)

SLACK = 0.25  # s of scheduling delay allowed on a busy 2-core machine


# ---------------------------------------------------------------- pure arithmetic

def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = list(rng.random(n))
        for q in (0, 50, 90, 99, 100):
            assert bs.percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert bs.percentile([], 50) is None


def test_tpot_and_summary():
    a = bs.RequestResult(ok=True, ttft=0.1, latency=1.1, itl=[0.25] * 4, output_tokens=11,
                         prompt_tokens=30)
    b = bs.RequestResult(ok=True, ttft=0.3, latency=0.3, output_tokens=1, prompt_tokens=10)
    bad = bs.RequestResult(ok=False, error="HTTP 500: boom")
    assert bs.tpot(a) == pytest.approx(0.1)
    assert bs.tpot(b) is None
    s = bs.summarize([a, b, bad], duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert s["total_output_tokens"] == 12 and s["total_prompt_tokens"] == 40
    assert s["output_tok_per_s"] == pytest.approx(6.0) and s["request_per_s"] == pytest.approx(1.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["tpot_ms"]["p99"] == pytest.approx(100.0)
    assert s["itl_ms"]["p90"] == pytest.approx(250.0)
    assert s["e2e_ms"]["p50"] == pytest.approx(700.0)
    assert "TTFT" in bs.format_table(s) and "1 / 1" not in bs.format_table(s)


def test_summary_of_nothing():
    s = bs.summarize([bs.RequestResult(error="x")], duration=0.0)
    assert s["completed"] == 0 and s["output_tok_per_s"] == 0.0 and s["ttft_ms"]["p50"] is None
    assert "-" in bs.format_table(s)


def test_prompts_are_seeded_and_sized():
    a = bs.make_prompts(20, 32, 64, seed=3)
    assert a == bs.make_prompts(20, 32, 64, seed=3) and a != bs.make_prompts(20, 32, 64, seed=4)
    assert all(32 <= len(p.split()) <= 64 for p in a)
    shared = bs.make_prompts(5, 8, 8, shared_prefix_len=100, seed=1)
    prefixes = {" ".join(p.split()[:100]) for p in shared}
    assert len(prefixes) == 1 and len({p.split(maxsplit=100)[-1] for p in shared}) == 5
    assert all(len(p.split()) == 108 for p in shared)


def test_poisson_arrivals_are_seeded_with_the_right_mean():
    a = bs.arrival_offsets(4000, rate=50.0, seed=7)
    assert a == bs.arrival_offsets(4000, rate=50.0, seed=7) != bs.arrival_offsets(4000, rate=50.0, seed=8)
    gaps = np.diff(a)
    assert a[0] == 0.0 and np.all(gaps >= 0)
    assert np.mean(gaps) == pytest.approx(1 / 50, rel=0.06)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.1)   # exponential: cv = 1
    regular = np.diff(bs.arrival_offsets(4000, rate=50.0, burstiness=16.0, seed=7))
    assert np.std(regular) / np.mean(regular) == pytest.approx(0.25, rel=0.1)  # gamma: cv = 1/sqrt(k)
    assert bs.arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        bs.arrival_offsets(3, rate=0.0)


def test_parse_sse_line():
    assert bs.parse_sse_line(b"data: [DONE]\n") == "DONE"
    assert bs.parse_sse_line(b'data: {"a": 1}\n') == {"a": 1}
    assert bs.parse_sse_line(b"\n") is None and bs.parse_sse_line(b": ping\n") is None


def test_payload_asks_for_the_same_token_count_everywhere():
    p = bs.build_payload("m", "hi", 128, extra={"cache_prompt": False})
    assert p["ignore_eos"] is True and p["max_tokens"] == 128 and p["stream"] is True
    assert p["stream_options"] == {"include_usage": True} and p["cache_prompt"] is False


# ---------------------------------------------------------------- client vs a stub SSE server

class Stub:
    """Streams `tokens` one-word chunks after `ttft` s, `itl` s apart. The prompt picks a failure:
    'http500', 'stream-error', 'no-done'; 'no-usage' omits the usage chunk."""

    def __init__(self, ttft=0.0, itl=0.0, tokens=4):
        self.ttft, self.itl, self.tokens = ttft, itl, tokens
        self.in_flight = self.max_in_flight = 0
        self.arrivals: list[float] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.arrivals.append(asyncio.get_running_loop().time())
        if body["prompt"] == "http500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, body)
        finally:
            self.in_flight -= 1

    async def _stream(self, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        send = lambda obj: resp.write(f"data: {json.dumps(obj)}\n\n".encode())
        await asyncio.sleep(self.ttft)
        for i in range(self.tokens):
            if i:
                await asyncio.sleep(self.itl)
            await send({"choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]})
            if body["prompt"] == "stream-error":
                await send({"error": {"message": "engine died"}})
        if body["prompt"] != "no-usage":
            await send({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": self.tokens}})
        if body["prompt"] != "no-done":
            await resp.write(b"data: [DONE]\n\n")
        return resp


async def _against_stub(stub: Stub, prompts, **kwargs):
    app = web.Application()
    app.router.add_post("/v1/completions", stub.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        payloads = [bs.build_payload("stub", p, stub.tokens) for p in prompts]
        return await bs.run_benchmark(f"http://127.0.0.1:{port}", payloads, **kwargs)
    finally:
        await runner.cleanup()


def test_known_delays_give_known_ttft_itl_tpot_and_throughput():
    stub = Stub(ttft=0.2, itl=0.05, tokens=5)      # 0.4 s per request
    results, duration = asyncio.run(_against_stub(stub, ["p"] * 8, concurrency=4))
    s = bs.summarize(results, duration)
    assert (s["completed"], s["failed"], stub.max_in_flight) == (8, 0, 4)
    assert s["total_output_tokens"] == 40 and s["total_prompt_tokens"] == 56
    assert 200 <= s["ttft_ms"]["p50"] <= 200 + SLACK * 1000
    assert 50 * 0.9 <= s["itl_ms"]["p50"] <= 50 + SLACK * 1000
    assert 50 * 0.9 <= s["tpot_ms"]["p50"] <= 50 + SLACK * 1000
    assert 400 <= s["e2e_ms"]["p50"] <= 400 + 2 * SLACK * 1000
    assert 0.8 <= duration <= 0.8 + 3 * SLACK                     # two waves of four
    assert s["output_tok_per_s"] == pytest.approx(40 / duration)
    assert all(len(r.itl) == 4 and r.chunks == 5 for r in results)


def test_failures_are_counted_not_raised():
    prompts = ["ok", "http500", "stream-error", "no-done", "ok"]
    results, duration = asyncio.run(_against_stub(Stub(tokens=3), prompts, concurrency=5))
    s = bs.summarize(results, duration)
    assert (s["completed"], s["failed"]) == (2, 3)
    errors = " | ".join(s["errors"])
    assert "HTTP 500" in errors and "engine died" in errors and "[DONE]" in errors


def test_connection_refused_is_a_failure():
    payloads = [bs.build_payload("m", "x", 4)]
    results, _ = asyncio.run(bs.run_benchmark("http://127.0.0.1:9", payloads))
    assert not results[0].ok and results[0].error


def test_without_usage_tokens_are_counted_from_chunks():
    results, _ = asyncio.run(_against_stub(Stub(tokens=6), ["no-usage"] * 2, concurrency=2))
    assert all(r.ok and r.output_tokens == 6 and r.prompt_tokens is None for r in results)


def test_request_rate_follows_the_seeded_schedule():
    stub = Stub(tokens=2)
    results, _ = asyncio.run(_against_stub(stub, ["p"] * 10, concurrency=10, request_rate=20.0, seed=5))
    expected = bs.arrival_offsets(10, 20.0, seed=5)
    sent = [r.start - results[0].start for r in results]
    assert all(r.ok for r in results) and len(stub.arrivals) == 10
    assert all(e - 0.005 <= s <= e + SLACK for s, e in zip(sent, expected))   # never early


def test_max_seconds_stops_sending():
    stub = Stub(tokens=2)
    results, duration = asyncio.run(_against_stub(stub, ["p"] * 50, concurrency=50,
                                                  request_rate=10.0, max_seconds=0.5, seed=1))
    expected = sum(t <= 0.5 for t in bs.arrival_offsets(50, 10.0, seed=1))
    assert expected - 2 <= len(results) <= expected + 2 and len(results) < 50
    assert duration < 0.5 + 2 * SLACK


# ---------------------------------------------------------------- bench_vs_llamacpp / plot_bench helpers

def _tool(name):
    sys.path.insert(0, str(_PATH.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(_PATH.parent))


def test_median_of_repeats_and_slot_context():
    bv = _tool("bench_vs_llamacpp")
    runs = [{"tok": 1.0, "ttft_ms": {"p50": 30.0, "p99": None}, "errors": []},
            {"tok": 5.0, "ttft_ms": {"p50": 10.0, "p99": 7.0}, "errors": ["x"]},
            {"tok": 2.0, "ttft_ms": {"p50": 20.0, "p99": 9.0}, "errors": []}]
    assert bv.median_summary(runs) == {"tok": 2.0, "ttft_ms": {"p50": 20.0, "p99": 8.0}, "errors": []}
    assert bv.Workload("c16", 16, 48).slot_context() == 768               # 512 + 128 + 64 -> 768
    assert bv.Workload("s", 16, 48, 16, 64, 64, shared_prefix=448).slot_context() == 768


def test_report_section_is_replaced_not_duplicated(tmp_path):
    pb = _tool("plot_bench")
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nanalysis by hand\n")
    for stamp in ("first", "second"):
        pb.splice(str(md), f"{pb.BEGIN}\n{stamp}\n{pb.END}\n")
    text = md.read_text()
    assert text.count(pb.BEGIN) == 1 and "second" in text and "first" not in text
    assert "analysis by hand" in text
