"""Where the time of one engine step goes, op by op (NumPy backend; run on an idle machine).

    python tools/profile_step.py --batch 16 --context 400          # decode steps
    python tools/profile_step.py --batch 1 --context 512 --prefill # one prefill of 512 tokens

Decode: `--batch` sequences with prompts of about `--context` tokens are prefilled, then
`--steps` decode steps are timed. Prefill: one request of `--context` prompt tokens and
max_tokens=1. Prints ms per step for every GEMM, attention, norms, RoPE, KV write and SiLU.

The real forward is timed: while profiling, the functions DecoderModel.forward calls (the ops, the
linear layers, the embedding, the fused layer call) are replaced in its module by timed wrappers,
so nothing is copied and profiling off costs nothing. By default the layers run as the engine
runs them, one host-kernel call each (cpu/layer.c); --op-by-op runs its op-by-op twin instead. "python" is the forward's time outside those calls; "engine"
is the step's time outside the forward (scheduling, sampling, detokenizing).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import make_prompts  # noqa: E402

import ember_cupy.model.decoder as decoder_module  # noqa: E402
from ember_cupy import ops  # noqa: E402
from ember_cupy.config import EngineConfig  # noqa: E402


class OpClock:
    """Seconds per op name. Only the outermost timed call is charged (the LM head's own
    matmul is not counted twice)."""

    def __init__(self):
        self.seconds = collections.Counter()
        self._depth = 0

    def reset(self) -> None:
        self.seconds.clear()

    def timed(self, name, function):
        def wrapper(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.seconds[name(*args) if callable(name) else name] += time.perf_counter() - start
        return wrapper


def _matrix_names(model) -> dict[int, str]:
    names = {id(model.lm_head): "lm_head"}
    for layer in model.layers:
        for field in ("qkv", "o", "gate_up", "down"):
            names[id(getattr(layer, field))] = f"gemm {field}"
    return names


@contextlib.contextmanager
def profiling(llm, clock: OpClock, op_by_op: bool = True):
    """Time llm's forward passes while the block runs: op by op (the model's unfused twin path),
    or with the decoder layers as the single host-kernel call the engine makes by default."""
    model = llm.engine.runner.model
    model.fuse_layers = not op_by_op
    names = _matrix_names(model)
    patched = {
        "ops": types.SimpleNamespace(**{n: clock.timed(n, getattr(ops, n)) for n in ops.__all__}),
        "linear": clock.timed(lambda x, w, *rest: names.get(id(w), "gemm"), decoder_module.linear),
        "embedding": clock.timed("embedding", decoder_module.embedding),
        "decoder_layers": clock.timed("decoder layers (one call)", decoder_module.decoder_layers),
    }
    saved = {name: getattr(decoder_module, name) for name in patched}
    hidden_states, logits = model.hidden_states, clock.timed("lm_head", model.logits)
    total = collections.Counter()

    def counted_in_forward(fn):   # the runner calls hidden_states, then logits
        def timed(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                total["forward"] += time.perf_counter() - start
        return timed

    model.hidden_states, model.logits = counted_in_forward(hidden_states), counted_in_forward(logits)
    for name, value in patched.items():
        setattr(decoder_module, name, value)
    try:
        yield total
    finally:
        for name, value in saved.items():
            setattr(decoder_module, name, value)
        del model.hidden_states, model.logits, model.fuse_layers


def profile_decode(llm, batch: int, context: int, steps: int, clock: OpClock, total) -> tuple[float, int]:
    from ember_cupy import SamplingParams
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i, text in enumerate(make_prompts(batch, context, context)):
        engine.add_request(f"profile-{i}", text, params)
    engine.step()
    while any(seq.num_uncomputed_tokens > 1 for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    clock.reset()
    total.clear()
    start, count = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        count += 1
    return time.perf_counter() - start, count


def profile_prefill(llm, context: int, clock: OpClock, total) -> tuple[float, int]:
    from ember_cupy import SamplingParams
    warm, measured = make_prompts(2, context, context)
    llm.generate([warm], SamplingParams(max_tokens=1))   # warm the pool's pages
    clock.reset()
    total.clear()
    start = time.perf_counter()
    llm.generate([measured], SamplingParams(max_tokens=1))
    return time.perf_counter() - start, 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF or HF directory (default: SmolLM2 Q4_1)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=400, help="prompt words (about tokens)")
    ap.add_argument("--steps", type=int, default=20, help="decode steps to time")
    ap.add_argument("--prefill", action="store_true", help="time one prefill instead")
    ap.add_argument("--quantization", default="auto", choices=["auto", "none", "q8_0"])
    ap.add_argument("--second-pass-threshold", type=float, default=EngineConfig.second_pass_threshold,
                    help="which activation blocks get the second int8 pass (0: every block)")
    ap.add_argument("--op-by-op", action="store_true",
                    help="run the layers op by op (the fused layer's twin) to see each op's share")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from ember_cupy import LLM
    llm = LLM(args.model, max_num_seqs=max(64, args.batch), enable_prefix_caching=False,
              quantization=args.quantization, second_pass_threshold=args.second_pass_threshold)
    clock = OpClock()
    with profiling(llm, clock, op_by_op=args.op_by_op) as total:
        if args.prefill:
            seconds, steps = profile_prefill(llm, args.context, clock, total)
        else:
            seconds, steps = profile_decode(llm, args.batch, args.context, args.steps, clock, total)
    clock.seconds["python"] = total["forward"] - sum(clock.seconds.values())
    clock.seconds["engine"] = seconds - total["forward"]
    per_step = {name: round(s / steps * 1e3, 2) for name, s in clock.seconds.most_common()}
    result = {"mode": "prefill" if args.prefill else "decode", "batch": 1 if args.prefill else args.batch,
              "context": args.context, "ms_per_step": round(seconds / steps * 1e3, 2), "ops_ms": per_step}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['mode']} batch {result['batch']} context ~{args.context}: {result['ms_per_step']} ms per step")
        for name, ms in per_step.items():
            print(f"  {name:<14} {ms:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
