"""The cost of structured decoding: engine step time at 1 and 16 streams, free vs JSON-schema
constrained, and grammar compile times. Run on an idle machine (it times wall clock):

    python tools/bench_structured.py --steps 48 --repeats 3 > structured.json

Step time: the median wall time of LLMEngine.step() over --steps decode steps (every sequence
decoding, none finished: the schema forces a long string, and the free run ignores EOS), for the
same prompts with and without the constraint; the overhead is constrained / free - 1 (the
issue's target: <= 5%). Also timed alone: filling the bitmasks of 1 and 16 matchers and applying
them to the logits. Compile: llguidance's tokenizer (once per engine), then each schema cold (a
fresh cache) and from the cache.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from ember_cupy import LLM, SamplingParams
from ember_cupy.structured import StructuredOutputsParams
from ember_cupy.structured.bitmask import apply_token_bitmask, fill_bitmasks
from ember_cupy.structured.compiler import GrammarCompiler

LONG_STRING = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
               "required": ["story"]}
COMPILE_SCHEMAS = {
    "flat": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
             "required": ["a", "b"]},
    "nested_ref": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"},
                                                                    "y": {"type": "number"}}}},
                   "type": "object", "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/p"},
                                                               "minItems": 1, "maxItems": 8}}},
    "formats": {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                                 "mail": {"type": "string", "format": "email"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    "tools_required": {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": f"tool_{i}"}, "arguments": {
            "type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer", "minimum": 0}},
            "required": ["q"]}}, "required": ["name", "arguments"]} for i in range(16)]}},
}


def median_step_ms(llm: LLM, num_streams: int, params: SamplingParams, steps: int, warmup: int = 3) -> float:
    engine = llm.engine
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a long story as JSON."}])
    ids = [f"bench-{num_streams}-{time.monotonic_ns()}-{i}" for i in range(num_streams)]
    for request_id in ids:
        engine.add_request(request_id, prompt, params, add_special_tokens=False)
    while engine.num_waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()   # prefill
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        engine.step()
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
        if engine.num_running < num_streams:
            raise RuntimeError("a sequence finished during the timed steps: raise max_tokens / minLength")
    for request_id in ids:
        engine.abort(request_id)
    return statistics.median(times)


def mask_ms(llm: LLM, num_streams: int, repeats: int = 50) -> dict:
    compiler = llm.engine.grammars
    constraints = [compiler.new_constraint(StructuredOutputsParams(json=LONG_STRING)) for _ in range(num_streams)]
    for c in constraints:   # into the string, where the mask is widest
        for token in llm.tokenizer.encode('{"story": "Once', add_special_tokens=False):
            c.accept(token)
    vocab = llm.engine.model_config.vocab_size
    logits = np.zeros((num_streams, vocab), np.float32)
    fill, apply = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        mask = fill_bitmasks(constraints, vocab)
        fill.append(time.perf_counter() - start)
        start = time.perf_counter()
        apply_token_bitmask(logits, mask, np.arange(num_streams, dtype=np.int32))
        apply.append(time.perf_counter() - start)
    return {"fill_ms": statistics.median(fill) * 1e3, "apply_ms": statistics.median(apply) * 1e3}


def compile_ms(llm: LLM) -> dict:
    start = time.perf_counter()
    cold = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size)
    _ = cold.ll_tokenizer
    out = {"ll_tokenizer_ms": (time.perf_counter() - start) * 1e3}
    for name, schema in COMPILE_SCHEMAS.items():
        params = StructuredOutputsParams(json=schema)
        fresh = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size)
        fresh._ll_tokenizer = cold.ll_tokenizer   # time the grammar alone
        start = time.perf_counter()
        fresh.compile(params)
        first = time.perf_counter() - start
        start = time.perf_counter()
        fresh.new_constraint(params)
        cached = time.perf_counter() - start
        out[name] = {"cold_ms": first * 1e3, "cached_constraint_ms": cached * 1e3}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is reported")
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=16)
    max_tokens = args.steps + 64
    free = SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=LONG_STRING))
    result = {"steps": {}, "mask": {}, "compile": compile_ms(llm)}
    for streams in (1, 16):
        runs = {"free": [], "json_schema": []}
        for repeat in range(args.repeats):   # interleaved, the order flipped every repeat: the
            pairs = [("free", free), ("json_schema", constrained)]   # machine drifts within a run
            for name, params in pairs if repeat % 2 == 0 else pairs[::-1]:
                runs[name].append(median_step_ms(llm, streams, params, args.steps))
        cell = {f"{name}_ms": statistics.median(times) for name, times in runs.items()}
        cell["overhead"] = cell["json_schema_ms"] / cell["free_ms"] - 1
        result["steps"][f"{streams}_streams"] = cell
        result["mask"][f"{streams}_streams"] = mask_ms(llm, streams)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
