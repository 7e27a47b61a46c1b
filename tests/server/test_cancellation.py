"""Disconnecting clients abort their requests within a step and free their KV blocks."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
from server_helpers import MODEL, metric

from ember_cupy.engine.llm_engine import LLMEngine


async def _sse_events(response):
    async for line in response.content:
        line = line.strip()
        if line.startswith(b"data: "):
            yield line[6:]


def _wait_idle(base_url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric(base_url, "ember:num_requests_running") == 0
                and metric(base_url, "ember:num_requests_waiting") == 0
                and metric(base_url, "ember:kv_cache_free_blocks") == metric(base_url, "ember:kv_cache_total_blocks")):
            return
        time.sleep(0.05)


def test_half_of_twenty_streams_disconnect(base_url):
    url = base_url + "/v1/completions"
    _wait_idle(base_url)
    aborted_before = metric(base_url, "ember:request_success_total", finished_reason="abort") or 0.0

    async def disconnecting(session, i):
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True}
        response = await session.post(url, json=body)
        assert response.status == 200
        seen = 0
        async for _ in _sse_events(response):
            seen += 1
            if seen == 2:
                break
        response.close()    # drop the connection mid-stream
        return seen

    async def completing(session, i, stream):
        body = {"model": MODEL, "prompt": f"Poem number {i}:", "max_tokens": 6, "temperature": 0.8,
                "seed": 1000 + i, "stream": stream}
        async with session.post(url, json=body) as response:
            assert response.status == 200
            if not stream:
                data = await response.json()
                return data["choices"][0]["text"], data["choices"][0]["finish_reason"]
            text, reason, done = "", None, False
            async for data in _sse_events(response):
                if data == b"[DONE]":
                    done = True
                    continue
                choice = json.loads(data)["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
            assert done
            return text, reason

    async def run():
        async with aiohttp.ClientSession() as session:
            streamed = await asyncio.gather(*[disconnecting(session, i) for i in range(10)],
                                            *[completing(session, i, True) for i in range(10)])
        async with aiohttp.ClientSession() as session:   # the same seeds, not streamed
            full = await asyncio.gather(*[completing(session, i, False) for i in range(10)])
        return streamed, full

    streamed, full = asyncio.run(asyncio.wait_for(run(), 120))
    assert streamed[:10] == [2] * 10
    assert streamed[10:] == full
    assert all(reason in ("stop", "length") for _, reason in full)
    _wait_idle(base_url)
    assert metric(base_url, "ember:num_requests_running") == 0
    assert metric(base_url, "ember:num_requests_waiting") == 0
    assert metric(base_url, "ember:kv_cache_free_blocks") == metric(base_url, "ember:kv_cache_total_blocks")
    aborted = metric(base_url, "ember:request_success_total", finished_reason="abort") - aborted_before
    assert aborted == 10
    # the aborted requests stopped early: far fewer than 10 * 200 tokens were generated for them
    assert metric(base_url, "ember:request_generation_tokens_sum") < 10 * 200


def test_metrics_names(base_url):
    for name in ("ember:num_requests_running", "ember:num_requests_waiting", "ember:kv_cache_usage_perc",
                 "ember:prefix_cache_queries_total", "ember:prefix_cache_hits_total",
                 "ember:prompt_tokens_total", "ember:generation_tokens_total",
                 "ember:time_to_first_token_seconds_count", "ember:inter_token_latency_seconds_count",
                 "ember:e2e_request_latency_seconds_count", "ember:request_queue_time_seconds_count",
                 "ember:kv_cache_free_blocks", "ember:kv_cache_total_blocks"):
        assert metric(base_url, name) is not None, name


class _HoldingEngine(LLMEngine):
    """Runs steps until one yields output (a prompt's KV blocks taken, a first token), then runs
    no more: a request it holds ends only by an abort, however fast the machine is."""
    holding = False

    def step(self):
        if self.holding:
            time.sleep(0.01)
            return []
        outputs = super().step()
        self.holding = bool(outputs)
        return outputs


def test_non_streaming_client_timeout_aborts(start_server):
    url = start_server(engine_factory=_HoldingEngine, num_kv_blocks=16).url

    def running() -> bool:
        return metric(url, "ember:num_requests_running") == 1

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            body = {"model": MODEL, "prompt": "A very long answer:", "max_tokens": 100, "ignore_eos": True}
            request = asyncio.ensure_future(session.post(url + "/v1/completions", json=body))
            while not request.done() and not await asyncio.to_thread(running):
                await asyncio.sleep(0.05)
            assert metric(url, "ember:kv_cache_free_blocks") < metric(url, "ember:kv_cache_total_blocks")
            try:
                async with await request as response:
                    await response.read()
            except TimeoutError:
                return "timed out"
        return "finished"

    assert asyncio.run(run()) == "timed out"
    _wait_idle(url)
    assert metric(url, "ember:num_requests_running") == 0
    assert metric(url, "ember:kv_cache_free_blocks") == metric(url, "ember:kv_cache_total_blocks")
    assert metric(url, "ember:request_success_total", finished_reason="abort") == 1
