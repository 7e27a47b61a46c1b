"""Issue 14 item 5: /metrics serves vLLM's series (`vllm:` prefix, model_name and engine labels)
beside `ember:`, with the queue and KV gauges gateways route on; one access-log line a request."""
from __future__ import annotations

import json
import logging
import re
import threading
import time
import urllib.request

import pytest
from server_helpers import MODEL, http, metric, metrics

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def two_slots(start_server):
    """A server with two sequence slots: an n=2 request takes both, the next one must wait."""
    return start_server(num_kv_blocks=NUM_BLOCKS, max_num_seqs=2).url


def _samples(url: str) -> list[tuple[str, dict, float]]:
    _, _, text = http(url, "GET", "/metrics")
    rows = []
    for line in text.decode().splitlines():
        match = re.match(r"^([\w:]+)(\{[^}]*\})?\s+(\S+)$", line)
        if match:
            rows.append((match.group(1), dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or "")),
                         float(match.group(3))))
    return rows


def _completion(url: str, prompt: str, **fields) -> dict:
    status, _, raw = http(url, "POST", "/v1/completions",
                          {"model": MODEL, "prompt": prompt, "ignore_eos": True, **fields})
    assert status == 200, raw
    return json.loads(raw)


def _wait(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def _idle(url: str) -> bool:
    return _wait(lambda: metric(url, "vllm:num_requests_running") == 0
                 and metric(url, "vllm:num_requests_waiting") == 0)


VLLM_SERIES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
    "vllm:request_success_total", "vllm:iteration_tokens_total_count", "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
    "vllm:request_inference_time_seconds_count", "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count", "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count", "vllm:request_params_n_count",
    "vllm:request_params_max_tokens_count", "vllm:cache_config_info",
    "vllm:request_max_num_generation_tokens_count",
)


def test_every_vllm_series_is_served_with_model_name_and_engine_labels(two_slots):
    _completion(two_slots, "Name a colour:", max_tokens=2)
    samples = _samples(two_slots)
    for name in VLLM_SERIES:
        labels = [labels for sample, labels, _ in samples if sample == name]
        assert labels, f"{name} missing from /metrics"
        assert all(lab.get("model_name") == MODEL and lab.get("engine") == "0" for lab in labels), (name, labels)
    ember = {sample.removeprefix("ember:") for sample, _, _ in samples if sample.startswith("ember:")}
    vllm = {sample.removeprefix("vllm:") for sample, _, _ in samples if sample.startswith("vllm:")}
    assert ember <= vllm    # every ember: series has its vllm: twin


def test_request_series_count_what_a_request_asked_for_and_computed(two_slots):
    assert _idle(two_slots)
    before = {name: metric(two_slots, name) or 0.0 for name in (
        "vllm:request_params_n_sum", "vllm:request_params_max_tokens_sum", "vllm:iteration_tokens_total_sum",
        "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count", "vllm:generation_tokens_total",
        "vllm:request_max_num_generation_tokens_sum")}
    n, max_tokens = 2, 4
    body = _completion(two_slots, "A short unique prompt about owls", n=n, max_tokens=max_tokens)
    prompt_tokens = body["usage"]["prompt_tokens"]

    def delta(name):
        return metric(two_slots, name) - before[name]

    assert delta("vllm:request_params_n_sum") == n
    assert delta("vllm:request_params_max_tokens_sum") == max_tokens
    assert delta("vllm:generation_tokens_total") == n * max_tokens
    assert delta("vllm:request_max_num_generation_tokens_sum") == max_tokens    # the most of one completion
    # the prompt once (under 16 tokens: no full block to reuse), then each sequence's last token
    # for every token after its first
    assert delta("vllm:iteration_tokens_total_sum") == prompt_tokens + n * (max_tokens - 1)
    for phase in ("prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 1, phase
    prefill = metric(two_slots, "vllm:request_prefill_time_seconds_sum")
    inference = metric(two_slots, "vllm:request_inference_time_seconds_sum")
    assert 0 < prefill < inference


def test_cache_config_info_describes_the_kv_pool(two_slots):
    info = [labels for name, labels, value in _samples(two_slots) if name == "vllm:cache_config_info" and value == 1]
    assert len(info) == 1
    assert info[0]["block_size"] == "16"
    assert info[0]["num_gpu_blocks"] == str(NUM_BLOCKS) == str(int(metric(two_slots, "vllm:kv_cache_total_blocks")))
    assert info[0]["enable_prefix_caching"] == "true"


def test_queue_and_kv_gauges_follow_the_scheduler(two_slots):
    """Gateways route on these: a request that waits for a slot counts as waiting, the running
    sequences as running, and their KV blocks as used; all back to zero when done."""
    assert _idle(two_slots)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
            "n": 2, "stream": True}
    request = urllib.request.Request(two_slots + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    response = urllib.request.urlopen(request, timeout=60)
    try:
        response.readline()                       # the long stream is running
        waiter = threading.Thread(target=_completion, args=(two_slots, "Second in line:"),
                                  kwargs={"max_tokens": 2})
        waiter.start()
        assert _wait(lambda: metric(two_slots, "vllm:num_requests_waiting") == 1), "the second never waited"
        assert metric(two_slots, "vllm:num_requests_running") == 2
        usage, gpu_usage = metrics(two_slots, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
        assert 0 < usage <= 1
        assert gpu_usage == usage                 # one read: the stream's blocks grow between two
    finally:
        response.close()                          # the server aborts the long stream
    waiter.join(60)
    assert _idle(two_slots)
    assert metric(two_slots, "vllm:kv_cache_usage_perc") == 0


def test_one_access_log_line_per_request_without_the_prompt(two_slots, caplog):
    caplog.set_level(logging.INFO, logger="ember_cupy.server.access")
    secret = "purple elephants dance"
    body = _completion(two_slots, secret, max_tokens=3, stream=False)
    http(two_slots, "POST", "/v1/completions", {"model": MODEL, "prompt": secret, "max_tokens": -1})
    http(two_slots, "GET", "/health")
    lines = [r.getMessage() for r in caplog.records if r.name == "ember_cupy.server.access"]
    info = [r.getMessage() for r in caplog.records
            if r.name == "ember_cupy.server.access" and r.levelno == logging.INFO]
    assert not any(secret in line for line in lines)
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert re.fullmatch(rf"127\.0\.0\.1 POST /v1/completions 200 prompt_tokens={prompt_tokens} "
                        r"completion_tokens=3 \d+\.\d{3}s", info[0]), info
    assert re.fullmatch(r"127\.0\.0\.1 POST /v1/completions 400 prompt_tokens=0 completion_tokens=0 \S+s",
                        info[1]), info
    assert len(info) == 2            # /health is a probe: debug level


def test_an_embedding_request_finishes_as_vllm_counts_a_pooling_request(two_slots):
    def finished(reason):
        return metric(two_slots, "vllm:request_success_total", finished_reason=reason) or 0.0
    before = {reason: finished(reason) for reason in ("stop", "unknown")}
    status, _, _ = http(two_slots, "POST", "/v1/embeddings", {"model": MODEL, "input": "an owl"})
    assert status == 200
    assert finished("stop") == before["stop"] + 1 and finished("unknown") == before["unknown"] == 0
