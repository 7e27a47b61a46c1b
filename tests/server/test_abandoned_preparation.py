"""Work before admission that its request gave up on (a prepare timeout, a disconnected client),
through the AsyncEngine API on the real model, with preparations held on a gate the test opens:
work not started never starts, and work still running is refused company (503) until it ends."""
from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from ember_cupy.engine.llm_engine import LLMEngine
from ember_cupy.sampling_params import SamplingParams
from ember_cupy.server.async_engine import SMALL_TEXT_CHARS, EngineOverloadedError, PrepareTimeoutError
from ember_cupy.server.prepare_workers import SLOW_WORK_NICE, PrepareWorkers
from ember_cupy.structured import StructuredOutputsParams

HELD = "held"          # a regex containing it compiles only once the gate opens
PATIENCE = 30          # seconds a held job waits for the gate at most


class GatedBuilds:
    """Wraps an engine's grammar builds: records each build, holds those of HELD regexes."""

    def __init__(self, grammars):
        self.gate = threading.Event()
        self.built: list[str] = []
        self._build = grammars._build
        grammars._build = self

    def __call__(self, params):
        self.built.append(params.spec)
        if HELD in params.spec:
            self.gate.wait(PATIENCE)
        return self._build(params)


@pytest.fixture
def gated(start_server):
    builds = {}

    def engine(checkpoint, config):
        llm_engine = LLMEngine(checkpoint, config)
        llm_engine.grammars.ll_tokenizer   # built now: not within a request's prepare timeout
        builds["gated"] = GatedBuilds(llm_engine.grammars)
        return llm_engine

    server = start_server(engine_factory=engine, async_engine={"prepare_timeout": 0.5}, max_waiting=1)
    yield server, builds["gated"]
    builds["gated"].gate.set()


def constrained(regex: str) -> SamplingParams:
    return SamplingParams(max_tokens=3, temperature=0, structured_outputs=StructuredOutputsParams(regex=regex))


async def wait_for(condition, seconds: float = PATIENCE) -> bool:
    for _ in range(int(seconds / 0.02)):
        if condition():
            return True
        await asyncio.sleep(0.02)
    return False


def test_a_compile_its_request_gave_up_on_never_starts(gated):
    """Builds take turns: a compile whose client left while it waited for the build before it, and
    one that timed out queued for a thread, are never built once their turn comes."""
    server, builds = gated
    engine = server.engine
    engine.max_waiting = None   # this test is about what runs, not about refusals

    async def run():
        first = asyncio.ensure_future(engine.add_request("Hi", constrained(f"{HELD}[a-z]")))
        assert await wait_for(lambda: builds.built)          # building, held at the gate
        left = asyncio.ensure_future(engine.add_request("Hi", constrained("gone[a-z]")))
        await asyncio.sleep(0.2)                             # its compile waits for the first's turn
        left.cancel()                                        # its client disconnected
        timed_out = asyncio.ensure_future(engine.add_request("Hi", constrained("late[a-z]")))
        for task, expected in ((first, PrepareTimeoutError), (left, asyncio.CancelledError),
                               (timed_out, PrepareTimeoutError)):
            with pytest.raises(expected):
                await task
        builds.gate.set()
        assert await wait_for(lambda: engine.engine.grammars.num_cached == 1)   # the first's build ended
        again = await (await engine.add_request("Hi", constrained("late[a-z]"))).final()
        return list(builds.built), again

    built, again = server.call(run)
    assert built == [f"{HELD}[a-z]", "late[a-z]"], built   # "late" once, for the request sent again
    assert again.outputs[0].text.startswith("late")


async def admitted_eventually(call, seconds: float = PATIENCE):
    """call()'s result once it is no longer refused as overloaded."""
    for _ in range(int(seconds / 0.02)):
        try:
            return await call()
        except EngineOverloadedError:
            await asyncio.sleep(0.02)
    raise AssertionError("still refused")


def test_abandoned_work_still_running_counts_against_max_waiting(gated):
    """max_waiting 1: a large text whose tokenizing is abandoned while it runs holds the place of a
    waiting request until it really ends: the next large text is refused (503), then admitted."""
    server, _ = gated
    engine = server.engine
    gate, ended = threading.Event(), threading.Event()
    large = SMALL_TEXT_CHARS + 1

    def held():
        gate.wait(PATIENCE)
        ended.set()

    async def run():
        with pytest.raises(PrepareTimeoutError):
            await engine.off_loop(held, work_chars=large)
        with pytest.raises(EngineOverloadedError):
            await engine.off_loop(len, "text", work_chars=large)
        gate.set()
        assert await wait_for(ended.is_set)
        return await admitted_eventually(lambda: engine.off_loop(len, "text", work_chars=large))

    assert server.call(run) == 4


def test_queued_work_its_request_gave_up_on_never_starts(gated):
    """Both large-text threads held: a third job queued behind them times out and never runs."""
    server, _ = gated
    engine = server.engine
    gate, ran = threading.Event(), threading.Event()
    large = SMALL_TEXT_CHARS + 1
    engine.max_waiting = None   # this test is about the queue, not about refusals

    async def run():
        holders = [asyncio.ensure_future(engine.off_loop(gate.wait, PATIENCE, work_chars=large)) for _ in range(2)]
        await asyncio.sleep(0.1)
        with pytest.raises(PrepareTimeoutError):
            await engine.off_loop(ran.set, work_chars=large)
        gate.set()
        for holder in holders:
            with pytest.raises(PrepareTimeoutError):
                await holder
        return await engine.off_loop(len, "text", work_chars=large)

    assert server.call(run) == 4
    assert not ran.is_set()


@pytest.mark.skipif(not hasattr(os, "setpriority") or sys.platform != "linux", reason="per-thread nice is Linux's")
def test_slow_preparation_runs_below_the_engines_priority():
    """Large texts and grammar compiles run SLOW_WORK_NICE below the engine's priority, as do the threads they start (a
    grammar build's large-stack thread): under a 4 x 4 MB /tokenize attack a small chat's p99 went
    from 1.6 s to 1.1 s (idle 0.07-0.11 s). Small texts keep the engine's priority."""
    def nice_here_and_in_a_thread_started_here(_abandoned):
        started = []
        thread = threading.Thread(target=lambda: started.append(os.getpriority(os.PRIO_PROCESS, 0)))
        thread.start()
        thread.join()
        return os.getpriority(os.PRIO_PROCESS, 0), started[0]

    base = os.getpriority(os.PRIO_PROCESS, 0)
    slow, small = PrepareWorkers("test-slow", slow=True), PrepareWorkers("test-small", slow=False)
    try:
        lowered = min(19, base + SLOW_WORK_NICE)
        assert slow.submit(nice_here_and_in_a_thread_started_here).result() == (lowered, lowered)
        assert small.submit(nice_here_and_in_a_thread_started_here).result() == (base, base)
    finally:
        slow.shutdown()
        small.shutdown()
