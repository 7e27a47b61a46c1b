"""Offline throughput of `LLM.generate`, for quick A/B of engine changes (no HTTP, no peer).

    python tools/bench_offline.py --num-prompts 32 --max-tokens 128

Two passes over the same seeded prompts (see bench_serving.make_prompts): a prefill pass with
max_tokens=1 gives prefill tok/s; the full pass (ignore_eos, so every prompt makes --max-tokens
tokens) gives output tok/s, and decode tok/s = (output tokens - prompts) / (full time - prefill
time). Prefix caching is off unless --prefix-caching, so the second pass recomputes the prompts.
Per-request TTFT / TPOT come from RequestOutput.metrics; peak RSS from getrusage.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import make_prompts, percentile


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def timed_generate(llm, prompts, params):
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return outputs, time.perf_counter() - start


def request_stats(outputs) -> dict:
    """Median / p90 TTFT and TPOT (ms) from the engine's own per-sequence timings."""
    ttft, tpot = [], []
    for out in outputs:
        m, n = out.metrics, len(out.outputs[0].token_ids)
        if m is None or m.first_token_time is None:
            continue
        ttft.append(m.first_token_time - m.arrival_time)
        if n > 1 and m.last_token_time is not None:
            tpot.append((m.last_token_time - m.first_token_time) / (n - 1))
    ms = lambda xs, q: None if not xs else round(percentile(xs, q) * 1000, 2)
    return {"ttft_ms_p50": ms(ttft, 50), "ttft_ms_p90": ms(ttft, 90),
            "tpot_ms_p50": ms(tpot, 50), "tpot_ms_p90": ms(tpot, 90)}


def run(args) -> dict:
    from ember_cupy import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=args.prefix_caching)
    load_s, rss_loaded = time.perf_counter() - t0, peak_rss_mib()
    prompts = make_prompts(args.num_prompts, args.prompt_len_min, args.prompt_len_max, seed=args.seed)
    llm.generate(make_prompts(2, 16, 16, seed=args.seed + 999),
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    greedy = dict(temperature=0.0, ignore_eos=True)
    first, t_prefill = timed_generate(llm, prompts, SamplingParams(max_tokens=1, **greedy))
    outs, t_full = timed_generate(llm, prompts, SamplingParams(max_tokens=args.max_tokens, **greedy))
    prompt_tokens = sum(len(o.prompt_token_ids) for o in first)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    decode_s = t_full - t_prefill
    return {"num_prompts": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
            "load_s": round(load_s, 2), "prefill_s": round(t_prefill, 3), "full_s": round(t_full, 3),
            "prefill_tok_per_s": round(prompt_tokens / t_prefill, 1),
            "output_tok_per_s": round(out_tokens / t_full, 1),
            "decode_tok_per_s": round((out_tokens - len(prompts)) / decode_s, 1) if decode_s > 0 else None,
            "total_tok_per_s": round((prompt_tokens + out_tokens) / t_full, 1),
            **request_stats(outs),
            "rss_after_load_mib": round(rss_loaded, 1), "peak_rss_mib": round(peak_rss_mib(), 1)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len-min", type=int, default=32)
    ap.add_argument("--prompt-len-max", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="runs; the median of each figure is shown")
    ap.add_argument("--json", default=None, help="write the result here")
    return ap.parse_args(argv)


def median_of(runs: list[dict]) -> dict:
    keys = runs[0].keys()
    return {k: statistics.median(r[k] for r in runs) if all(r[k] is not None for r in runs)
            else None for k in keys}


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = [run(args) for _ in range(args.repeats)]
    result = median_of(runs) if len(runs) > 1 else runs[0]
    for key, value in result.items():
        print(f"{key:<22}{value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "result": result, "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
