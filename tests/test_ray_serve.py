"""ember-cupy on Ray Serve: 2 engine replicas (1 thread each) of the default model behind the
OpenAI ingress, on one local Ray cluster for the module (skipped only where Ray cannot start)."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'ember-cupy[ray]'")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "SmolLM2-135M-Instruct"
APP = "ember"
# 24 blocks of 16 tokens a replica: room for two system prompts' KV (10 blocks each) and the
# requests running on them, not for all four: routing decides what the caches can hold.
ENGINE = {"num_kv_blocks": 24, "max_model_len": 384, "max_num_seqs": 8, "block_size": 16}
SYSTEM_PROMPTS = [f"You are assistant number {i}. " + topic * 9 for i, topic in enumerate((
    "You answer questions about astronomy, stars, planets and galaxies with short precise facts. ",
    "You help people cook simple vegetarian dinners from what is left in their fridge tonight. ",
    "You explain the rules of chess and suggest openings to beginners in plain words only. ",
    "You translate short English sentences into French and explain the grammar you used. "))]
QUESTIONS = [f"Question {q}: what should I know first?" for q in range(8)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    os.environ.update(RAY_USAGE_STATS_ENABLED="0", EMBER_NUM_THREADS="1", EMBER_BACKEND="numpy")
    os.environ["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")  # workers import ember_cupy
    for attempt in range(3):   # on a loaded machine the first start can miss Ray's own deadlines
        try:
            # address="local": a cluster of its own, never one another process runs here
            ray.init(address="local", num_cpus=2, object_store_memory=200 << 20, include_dashboard=False,
                     log_to_driver=False)
            break
        except Exception as exc:  # noqa: BLE001 - any failure to start is the reason to skip
            ray.shutdown()
            if attempt == 2:
                pytest.skip(f"a local Ray cluster cannot start here: {type(exc).__name__}: {exc}")
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(router: str):
    from ember_cupy.ray_serve.app import build
    app = build({"num_replicas": 2, "num_cpus_per_replica": 0.5, "num_threads_per_replica": 1,
                 "router": router, "engine_config": ENGINE, "served_model_name": [MODEL],
                 "env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    serve.run(app, name=APP, route_prefix="/", blocking=False)
    deadline = time.monotonic() + 600
    while serve.status().applications[APP].status != "RUNNING":
        assert serve.status().applications[APP].status in ("DEPLOYING", "RUNNING"), serve.status()
        assert time.monotonic() < deadline, "the application did not start within 10 minutes"
        time.sleep(1)


@pytest.fixture(scope="module")
def url(cluster):
    deploy("prefix")
    return cluster


def replicas() -> dict[str, dict]:
    """Each engine replica's stats (its record_routing_stats), by replica id, straight from its actor."""
    stats = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == "serve" and f"{APP}#EngineReplica#" in entry["name"]:
            actor = ray.get_actor(entry["name"], namespace="serve")
            try:
                s = ray.get(actor.record_routing_stats.remote(), timeout=60)
            except (ray.exceptions.RayError, TimeoutError):
                continue   # dead, or still starting
            stats[s["replica_id"]] = s
    return stats


def post(url: str, path: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


def chat(system: str, question: str, salt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": question}],
            "max_tokens": 2, "temperature": 0, "cache_salt": salt, **extra}


def stream_chat(url: str, body: dict) -> tuple[str, dict, float]:
    """(content, usage, seconds to the first content chunk) of a streamed chat completion."""
    start, ttft, text, usage = time.monotonic(), None, "", {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.monotonic() - start
                    text += piece
            usage = chunk.get("usage") or usage
    return text, usage, ttft if ttft is not None else time.monotonic() - start


def run_workload(url: str, salt: str, concurrency: int = 2) -> tuple[int, float]:
    """4 system prompts x 8 questions, interleaved (a fixed shuffle), `concurrency` at a time:
    (total cached prompt tokens, TTFT p50)."""
    jobs = [(s, q) for q in QUESTIONS for s in SYSTEM_PROMPTS]
    random.Random(0).shuffle(jobs)
    results, lock = [], threading.Lock()

    def worker():
        while True:
            with lock:
                if not jobs:
                    return
                system, question = jobs.pop()
            _, usage, ttft = stream_chat(url, chat(system, question, salt))
            with lock:
                results.append((usage["prompt_tokens_details"]["cached_tokens"], ttft))
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert len(results) == 32
    return sum(c for c, _ in results), statistics.median(t for _, t in results)


# --- tests ----------------------------------------------------------------------------------
def finished_by_replica(url: str) -> dict[str, float]:
    """The application's /metrics: finished requests (all finish reasons) per `replica` label,
    the same under the ember: name and its vllm: mirror."""
    response = httpx.get(url + "/metrics", timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    ours, vllms = (_sum_by_replica(response.text, prefix + "request_success_total") for prefix in ("ember:", "vllm:"))
    assert ours == vllms
    return ours


def _sum_by_replica(text: str, sample_name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == sample_name:
                assert sample.labels["model_name"] == MODEL
                counts[sample.labels["replica"]] = counts.get(sample.labels["replica"], 0) + sample.value
    return counts


def test_mixed_batch_succeeds_and_both_replicas_serve(url):
    before = {rid: s["requests_admitted"] for rid, s in replicas().items()}
    assert len(before) == 2
    finished_before = finished_by_replica(url)
    bodies = [("/v1/completions", {"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 3, "temperature": 0})
              for i in range(6)]
    bodies += [("/v1/chat/completions", chat(SYSTEM_PROMPTS[i % 4], f"Say {i}.", salt=f"mixed{i}"))
               for i in range(6)]
    responses = [None] * len(bodies)

    def send(i):
        responses[i] = post(url, *bodies[i])
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses]
    after = {rid: s["requests_admitted"] for rid, s in replicas().items()}
    served = {rid: after[rid] - before[rid] for rid in before}
    assert sum(served.values()) == len(bodies) and all(served.values()), served
    finished_after = finished_by_replica(url)   # the application's /metrics: every replica's counts
    assert {rid: finished_after[rid] - finished_before.get(rid, 0) for rid in finished_after} == served


def test_health_lists_every_replica(url):
    response = httpx.get(url + "/health", timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "ready"
    assert sorted(r["replica_id"] for r in body["replicas"]) == sorted(replicas())
    assert all(r["state"] == "ready" and r["error"] is None for r in body["replicas"]), body


def test_greedy_results_equal_the_plain_server(url, checkpoint):
    from ember_cupy.config import EngineConfig
    from ember_cupy.engine.llm_engine import LLMEngine
    from ember_cupy.server import AsyncEngine, BackgroundServer, ServerSettings
    plain = BackgroundServer(AsyncEngine(LLMEngine(checkpoint, EngineConfig(**ENGINE))),
                             ServerSettings(port=0, served_model_names=[MODEL])).start()
    try:
        completion = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        chat_body = chat(SYSTEM_PROMPTS[0], "Name one planet.", salt="equal", max_tokens=8)
        for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat_body)):
            ours, theirs = post(url, path, body).json(), post(plain.url, path, body).json()
            assert ours["choices"] == theirs["choices"] and ours["usage"] == theirs["usage"]
        assert stream_chat(url, chat_body)[0] == stream_chat(plain.url, chat_body)[0] \
            == theirs["choices"][0]["message"]["content"]
        embed = {"model": MODEL, "input": ["Paris is in France.", "Stars are far away."]}
        ours, theirs = post(url, "/v1/embeddings", embed).json(), post(plain.url, "/v1/embeddings", embed).json()
        assert ours["data"] == theirs["data"] and ours["usage"] == theirs["usage"]
    finally:
        plain.stop()


def test_errors_keep_the_servers_shapes(url):
    bad = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    too_long = post(url, "/v1/completions", {"model": MODEL, "prompt": "word " * 600, "max_tokens": 1})
    assert too_long.status_code == 400, too_long.text   # refused by the replica's engine
    assert too_long.json()["error"]["type"] == "invalid_request_error"


def test_prefix_routing_caches_more_than_round_robin(url, record_property):
    prefix_cached, prefix_ttft = run_workload(url, salt="prefix")
    deploy("round_robin")
    try:
        rr_cached, rr_ttft = run_workload(url, salt="round-robin")
    finally:
        deploy("prefix")
    record_property("cached_tokens", {"prefix": prefix_cached, "round_robin": rr_cached})
    record_property("ttft_p50_s", {"prefix": prefix_ttft, "round_robin": rr_ttft})
    print(f"\ncached_tokens prefix={prefix_cached} round_robin={rr_cached}; "
          f"TTFT p50 prefix={prefix_ttft:.3f}s round_robin={rr_ttft:.3f}s (2 cores shared: indicative)")
    assert prefix_cached >= 1.5 * rr_cached, (prefix_cached, rr_cached)


def test_dropped_stream_frees_the_replica(url):
    body = {**chat(SYSTEM_PROMPTS[1], "Tell me a long story.", salt="drop"), "max_tokens": 150,
            "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in got)
        busy = replicas()
        assert sum(s["num_running"] + s["num_waiting"] for s in busy.values()) == 1, busy
    cancelled = sum(s["requests_cancelled"] for s in busy.values())
    deadline = time.monotonic() + 60
    while True:
        stats = replicas()
        idle = all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_in_flight"] == 0
                   and s["num_free_blocks"] == s["kv_cache_blocks"] for s in stats.values())
        if idle and len(stats) == 2 and sum(s["requests_cancelled"] for s in stats.values()) == cancelled + 1:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.5)


def test_killed_replica_is_restarted_and_later_requests_succeed(url):
    old = replicas()
    victim = next(iter(old.values()))
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    os.kill(victim["pid"], signal.SIGKILL)
    statuses = [post(url, "/v1/completions", body).status_code for _ in range(6)]
    assert statuses == [200] * 6, statuses
    deadline = time.monotonic() + 600
    while True:
        now = replicas()
        if len(now) == 2 and victim["replica_id"] not in now:
            break
        assert time.monotonic() < deadline, f"Ray did not restart the replica: {now}"
        time.sleep(2)
    assert post(url, "/v1/completions", body).status_code == 200
