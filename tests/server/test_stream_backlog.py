"""Issue 11, defect 1: a stream reader that falls behind holds memory linear in what it has not
read (deltas, merged), not a full cumulative output per step; one that stops reading for longer
than the stall timeout is aborted and its KV blocks freed."""
from __future__ import annotations

import asyncio
import gc

from ember_cupy.config import EngineConfig
from ember_cupy.engine.llm_engine import LLMEngine
from ember_cupy.sampling_params import SamplingParams
from ember_cupy.server import AsyncEngine

LONG = SamplingParams(max_tokens=120, ignore_eos=True, temperature=0)


def held_by(stream) -> tuple[int, int]:
    """(characters in strings, ints in lists) reachable from a stream, apart from its engine."""
    seen, chars, ints = {id(stream._engine)}, 0, 0
    todo = [v for k, v in vars(stream).items() if k != "_engine"]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        if isinstance(obj, str):
            chars += len(obj)
        elif isinstance(obj, list):
            ints += sum(isinstance(x, int) for x in obj)
        todo.extend(gc.get_referents(obj))
    return chars, ints


async def _until(condition, timeout=60.0) -> bool:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return True
        await asyncio.sleep(0.02)
    return False


def _run(coro_fn, checkpoint, **engine_kwargs):
    async def main():
        llm_engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=64, max_model_len=512))
        engine = AsyncEngine(llm_engine, **engine_kwargs)
        await engine.start()
        try:
            return await coro_fn(engine, llm_engine)
        finally:
            await engine.shutdown()
    return asyncio.run(asyncio.wait_for(main(), 180))


def test_a_stalled_reader_holds_what_it_has_not_read_once(checkpoint):
    async def scenario(engine, llm_engine):
        stream = await engine.add_request("Tell me a long story about a dragon.", LONG)
        assert await _until(lambda: not llm_engine.has_unfinished_requests())
        held = held_by(stream)               # all 120 steps' outputs, never read
        output = await stream.__anext__()    # the reader comes back: one merged output
        return held, output, stream

    (chars, ints), output, stream = _run(scenario, checkpoint)
    c = output.outputs[0]
    # a cumulative output per step held ~120 x 60 token ids and ~120 x 250 characters here
    assert ints <= 2 * (120 + len(output.prompt_token_ids))
    assert chars <= 2 * len(output.prompt) + 200 + 2 * 120 * 16   # 120 tokens of at most 16 characters
    assert output.finished and len(c.token_ids) == 120 and c.finish_reason == "length"
    assert stream.backlog_size == (0, 0)


def test_a_reader_that_stops_reading_is_aborted_and_its_blocks_freed(checkpoint):
    async def scenario(engine, llm_engine):
        params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
        stream = await engine.add_request("Count to a thousand.", params)
        first = await stream.__anext__()     # reads once, then stops
        assert await _until(lambda: not llm_engine.has_unfinished_requests(), timeout=120)
        free = llm_engine.block_manager.num_free_blocks
        rest = [o async for o in stream]
        return first, rest, free, llm_engine.block_manager.num_blocks

    first, rest, free, total = _run(scenario, checkpoint, stream_stall_timeout=0.3)
    assert free == total                      # the KV blocks came back at the abort
    assert len(rest) == 1 and rest[0].finished
    c = rest[0].outputs[0]
    assert c.finish_reason == "abort"
    assert len(first.outputs[0].token_ids) + len(c.token_ids) < 400   # stopped well before the end
