"""--max-waiting counts the sequence slots that running n > 1 parents hold for their forks (issue 11
item 3 / item 10): a request that the next step cannot start because those slots are reserved
really waits."""
from __future__ import annotations

import asyncio

import pytest
from server_helpers import MAX_MODEL_LEN

from ember_cupy.config import EngineConfig
from ember_cupy.engine.llm_engine import LLMEngine
from ember_cupy.sampling_params import SamplingParams
from ember_cupy.server import AsyncEngine, EngineOverloadedError


def test_reserved_fork_slots_are_not_free(checkpoint):
    # 4 slots; a budget of 8 tokens a step keeps a 480-token prompt prefilling for 60 steps
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, num_kv_blocks=256, block_size=16,
                          max_model_len=MAX_MODEL_LEN)
    engine = AsyncEngine(LLMEngine(checkpoint, config), max_waiting=1)
    long_prompt = [1000 + i % 500 for i in range(480)]
    short = SamplingParams(max_tokens=1)

    async def run():
        await engine.start()
        try:
            forks = await engine.add_request(long_prompt, SamplingParams(n=4, max_tokens=1))
            # the parent runs and reserves 3 more slots: no slot is free, this one waits ...
            queued = await engine.add_request("Hi", short)
            assert engine.engine.num_waiting == 1 and engine.engine.num_slots_used == 4
            # ... so max_waiting=1 is reached
            with pytest.raises(EngineOverloadedError, match="1 requests are waiting"):
                await engine.add_request("Hello", short)
            for stream in (forks, queued):
                stream.close()
        finally:
            await engine.shutdown()

    asyncio.run(run())
