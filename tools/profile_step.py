"""Where the time of one engine step goes, op by op (NumPy backend; run on an idle machine).

    python tools/profile_step.py --batch 16 --context 400          # decode steps
    python tools/profile_step.py --batch 1 --context 512 --prefill # one prefill of 512 tokens

Decode: `--batch` sequences with prompts of about `--context` tokens are prefilled, then
`--steps` decode steps are timed. Prefill: one request of `--context` prompt tokens and
max_tokens=1. Prints ms per step for every GEMM, attention, norms, RoPE, KV write and SiLU.

The timing comes from `timed_forward`, a copy of LlamaModel.forward with a clock between ops;
tests/test_profile_step.py holds its logits equal to the real forward's, so the copy cannot
drift from the model unnoticed.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import make_prompts  # noqa: E402

from ember_cupy import ops  # noqa: E402


class OpClock:
    """Accumulates seconds per op name; `lap(name)` charges the time since the last lap."""

    def __init__(self):
        self.seconds = collections.Counter()
        self._last = time.perf_counter()

    def reset(self) -> None:
        self.seconds.clear()
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] += now - self._last
        self._last = now


def timed_forward(model, input_ids, batch, kv_caches, clock: OpClock):
    """LlamaModel.forward, op for op, with clock laps in between."""
    cfg = model.config
    clock.lap("other")
    hidden = model.embed[input_ids]
    residual = None
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
        if residual is None:
            residual = hidden
            x = ops.rms_norm(hidden, layer.attn_norm, cfg.rms_norm_eps)
        else:
            x, residual = ops.fused_add_rms_norm(hidden, residual, layer.attn_norm, cfg.rms_norm_eps)
        clock.lap("norm")
        hidden = _timed_attention(model, x, layer, batch, k_cache, v_cache, clock)
        x, residual = ops.fused_add_rms_norm(hidden, residual, layer.ffn_norm, cfg.rms_norm_eps)
        clock.lap("norm")
        gate_up = x @ layer.gate_up
        clock.lap("gemm gate_up")
        activated = ops.silu_and_mul(gate_up)
        clock.lap("silu_and_mul")
        hidden = activated @ layer.down
        clock.lap("gemm down")
    sampled = (hidden[batch.logits_indices], residual[batch.logits_indices])
    x, _ = ops.fused_add_rms_norm(*sampled, model.norm, cfg.rms_norm_eps)
    clock.lap("norm")
    logits = model._logits(x)
    clock.lap("lm_head")
    return logits


def _timed_attention(model, x, layer, batch, k_cache, v_cache, clock: OpClock):
    cfg = model.config
    qkv = x @ layer.qkv
    if layer.qkv_bias is not None:
        qkv += layer.qkv_bias
    clock.lap("gemm qkv")
    num_tokens = x.shape[0]
    q = qkv[:, :cfg.q_size].reshape(num_tokens, cfg.num_heads, cfg.head_dim)
    k = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[:, cfg.q_size + cfg.kv_size:].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    ops.apply_rope(q, k, batch.positions, model.cos_sin_cache, is_neox=True)
    clock.lap("rope")
    ops.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    clock.lap("write_kv")
    out = ops.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                              batch.query_start_loc, model.scale)
    clock.lap("attention")
    projected = out.reshape(num_tokens, cfg.q_size) @ layer.o
    clock.lap("gemm o")
    return projected


def install(llm, clock: OpClock) -> None:
    """Route llm's forward passes through timed_forward."""
    model = llm.engine.runner.model
    model.forward = lambda input_ids, batch, kv_caches: timed_forward(
        model, input_ids, batch, kv_caches, clock)


def profile_decode(llm, batch: int, context: int, steps: int, clock: OpClock) -> tuple[float, int]:
    from ember_cupy import SamplingParams
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i, text in enumerate(make_prompts(batch, context, context)):
        engine.add_request(f"profile-{i}", text, params)
    engine.step()
    while any(seq.num_uncomputed_tokens > 1 for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    clock.reset()
    start, count = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        count += 1
    return time.perf_counter() - start, count


def profile_prefill(llm, context: int, clock: OpClock) -> tuple[float, int]:
    from ember_cupy import SamplingParams
    warm, measured = make_prompts(2, context, context)
    llm.generate([warm], SamplingParams(max_tokens=1))   # warm the pool's pages
    clock.reset()
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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from ember_cupy import LLM
    llm = LLM(args.model, max_num_seqs=max(64, args.batch), enable_prefix_caching=False)
    clock = OpClock()
    install(llm, clock)
    if args.prefill:
        seconds, steps = profile_prefill(llm, args.context, clock)
    else:
        seconds, steps = profile_decode(llm, args.batch, args.context, args.steps, clock)
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
