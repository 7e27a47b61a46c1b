"""What automatic prefix caching buys on requests that share a long system prompt.

    python tools/bench_prefix_cache.py --num-requests 64 --system-tokens 300

Runs the same workload (each request = the shared system prompt + its own short question,
greedy, fixed output length) with prefix caching off, then on, in one process, and prints
the cache hit rate (prompt tokens served from cache / prompt tokens) and the speed-up.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import make_prompts  # noqa: E402


def workload(num_requests: int, system_tokens: int, question_tokens: int, seed: int) -> list[str]:
    system = make_prompts(1, system_tokens, system_tokens, seed=seed)[0]
    questions = make_prompts(num_requests, question_tokens, question_tokens, seed=seed + 1)
    return [f"{system}\n{question}" for question in questions]


def run(checkpoint, prompts, caching: bool, args) -> dict:
    from ember_cupy import LLM, SamplingParams
    llm = LLM(checkpoint, max_num_seqs=args.max_num_seqs, enable_prefix_caching=caching)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    stats = llm.engine.block_manager.prefix_stats
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"caching": caching, "seconds": round(seconds, 2),
            "hit_rate": round(stats.hits / max(1, stats.queries), 3),
            "cached_tokens": sum(o.num_cached_tokens for o in outputs), "prompt_tokens": prompt_tokens,
            "output_tok_per_s": round(output_tokens / seconds, 1),
            "total_tok_per_s": round((prompt_tokens + output_tokens) / seconds, 1),
            "token_ids": [o.outputs[0].token_ids for o in outputs]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=300)
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from ember_cupy.model.loader import load_checkpoint
    checkpoint = load_checkpoint(None)
    prompts = workload(args.num_requests, args.system_tokens, args.question_tokens, args.seed)
    off, on = (run(checkpoint, prompts, caching, args) for caching in (False, True))
    for result in (off, on):
        shown = {k: v for k, v in result.items() if k != "token_ids"}
        print(shown)
    print(f"same outputs: {off['token_ids'] == on['token_ids']}; speed-up with caching: "
          f"{off['seconds'] / on['seconds']:.2f}x (wall time), hit rate {on['hit_rate']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
