"""Issue 11 over HTTP against the real server: admission, timeouts, parser errors, auth, metrics."""
from __future__ import annotations

import asyncio
import json

import aiohttp
from server_helpers import MODEL


def _error(raw: bytes) -> dict:
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_max_waiting_counts_only_requests_that_really_wait(start_server):
    """A burst that fits in the free sequence slots is admitted at once: none of it waits."""
    server = start_server(max_waiting=4, max_num_seqs=64, num_kv_blocks=128)
    url = server.url + "/v1/completions"

    async def one(session, i):
        body = {"model": MODEL, "prompt": f"Item {i}", "max_tokens": 2, "temperature": 0}
        async with session.post(url, json=body) as response:
            return response.status, await response.read()

    async def run():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*[one(session, i) for i in range(20)])

    results = asyncio.run(asyncio.wait_for(run(), 120))
    assert [status for status, _ in results] == [200] * 20, [raw[:200] for _, raw in results]
