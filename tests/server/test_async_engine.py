"""AsyncEngine without HTTP: generate, early exit and task cancellation abort, bad input."""
from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
from server_helpers import metric

from ember_cupy.sampling_params import SamplingParams


async def _idle(engine, timeout=10.0):
    for _ in range(int(timeout / 0.01)):
        if engine.num_in_flight == 0 and engine.engine.num_running == 0:
            return True
        await asyncio.sleep(0.01)
    return False


def test_generate_streams_deltas(server):
    engine = server.engine
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=1)

    async def run():
        outputs = [o async for o in engine.generate("Hello", params)]
        whole = await (await engine.add_request("Hello", params)).final()
        return outputs, whole

    outputs, whole = server.call(run)
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    for o in outputs:   # each output carries only its step's text, tokens and logprobs
        c = o.outputs[0]
        assert c.text == c.delta_text and c.token_ids == c.delta_token_ids
        assert [lp.token_id for lp in c.logprobs] == c.token_ids
    c = whole.outputs[0]
    assert len(c.token_ids) == 3 and [lp.token_id for lp in c.logprobs] == c.token_ids
    assert "".join(o.outputs[0].text for o in outputs) == c.text
    assert [t for o in outputs for t in o.outputs[0].token_ids] == c.token_ids


def test_early_exit_and_cancel_abort(server):
    engine = server.engine
    long = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)

    async def run():
        gen = engine.generate("Tell me a story", long)
        async for _ in gen:
            break
        await gen.aclose()                  # leaving the loop early aborts the request
        assert await _idle(engine)

        async def consume():
            async for _ in engine.generate("Another story", long):
                pass
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.5)
        task.cancel()                        # a cancelled task aborts its request
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _idle(engine)

    assert server.call(run, timeout=60)
    assert metric(server.url, "ember:kv_cache_free_blocks") == metric(server.url, "ember:kv_cache_total_blocks")


def test_bad_input_raises_value_error(server):
    engine = server.engine

    async def run():
        errors = []
        for prompt, params in (("", None), ([10 ** 9], None), ("x" * 10, SamplingParams(max_tokens=10 ** 6))):
            try:
                await engine.add_request(prompt, params)
            except ValueError as exc:
                errors.append(str(exc))
        stream = await engine.add_request("dup", SamplingParams(max_tokens=1), request_id="same-id")
        try:
            await engine.add_request("dup", SamplingParams(max_tokens=1), request_id="same-id")
        except ValueError as exc:
            errors.append(str(exc))
        async for _ in stream:
            pass
        return errors

    errors = server.call(run)
    assert len(errors) == 4 and "empty" in errors[0] and "already in use" in errors[3]


def test_text_is_made_on_the_event_loop_not_in_the_step_thread(server, monkeypatch):
    """The step's worker thread schedules, runs the model, samples and updates; detokenizing and
    stop strings run on the event loop between two steps (engine/output_processor.py). A stop
    string still ends its sequence there: the text stops before it, and no token after it is
    reported."""
    from ember_cupy.detokenizer import IncrementalDetokenizer
    engine = server.engine
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def run(params):
        return threading.get_ident(), await (await engine.add_request("Name three colors.", params)).final()

    _, whole = server.call(lambda: run(greedy))
    text = whole.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    decode_new, threads = IncrementalDetokenizer._decode_new, []

    def recording(self, *args, **kwargs):
        threads.append(threading.get_ident())
        return decode_new(self, *args, **kwargs)
    monkeypatch.setattr(IncrementalDetokenizer, "_decode_new", recording)
    loop_thread, stopped = server.call(lambda: run(dataclasses.replace(greedy, stop=[stop])))
    c = stopped.outputs[0]
    assert threads and set(threads) == {loop_thread}
    assert (c.text, c.finish_reason, c.stop_reason) == (text[:text.index(stop)], "stop", stop)
    assert c.token_ids == whole.outputs[0].token_ids[:len(c.token_ids)] and len(c.token_ids) < 12
