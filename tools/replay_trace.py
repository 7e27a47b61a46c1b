#!/usr/bin/env python3
"""Replay a recorded request trace through the scheduler alone (no model) and print, per
request, when it was first scheduled and when it finished, in engine steps.

Trace: JSON Lines, one request a line:
  {"arrival_step": 0, "prompt_len": 120, "max_tokens": 32, "priority": 0,
   "prefix_id": 1, "prefix_len": 64, "request_id": "a"}   (the last four are optional)
The same trace and flags always give the same schedule.

  python tools/replay_trace.py tools/traces/example.jsonl --policy sjf --num-blocks 64
"""
from __future__ import annotations

import argparse
import json
import sys

from ember_cupy.config import POLICIES, EngineConfig
from ember_cupy.engine.trace_replay import TraceReplay, TraceRequest


def read_trace(path: str) -> list[TraceRequest]:
    trace = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            record.setdefault("request_id", f"req{line_no}")
            trace.append(TraceRequest(**record))
    return trace


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--policy", choices=POLICIES, default="fcfs")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--sjf-aging-steps", type=int, default=64)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          block_size=args.block_size, policy=args.policy, sjf_aging_steps=args.sjf_aging_steps,
                          enable_prefix_caching=not args.no_prefix_caching)
    trace = read_trace(args.trace)
    too_big = [r.request_id for r in trace if -(-(r.prompt_len + r.max_tokens) // args.block_size) > args.num_blocks]
    if too_big:
        parser.error(f"requests {too_big[:5]} can never fit in {args.num_blocks} blocks")
    run = TraceReplay(config, args.num_blocks)
    timelines = run.run(trace)
    rows = [vars(timelines[r.request_id]) for r in trace]
    for row in rows:
        row["queue_steps"] = row["first_scheduled_step"] - row["arrival_step"]
    if args.json:
        json.dump({"steps": run.scheduler.step_count, "requests": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(f"{'request':>10} {'arrive':>6} {'start':>6} {'queue':>6} {'finish':>6} {'preempt':>7} {'cached':>6}")
    for row in rows:
        print(f"{row['request_id']:>10} {row['arrival_step']:>6} {row['first_scheduled_step']:>6} "
              f"{row['queue_steps']:>6} {row['finished_step']:>6} {row['num_preemptions']:>7} "
              f"{row['num_cached_tokens']:>6}")
    print(f"total steps: {run.scheduler.step_count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
