"""What verifying drafts costs on a model, on this machine (issue 27): the time of a step of B
sequences that each verify k drafts (B * (1 + k) logits rows) against B plain decodes, from timed
forward passes (`ModelRunner.time_forward`, the shape the speculation gate calibrates with).

On the synthetic model shapes (tools/make_synthetic_gguf.py) acceptance means nothing (random
weights write random text), so this cost is what to report there. From it, the break-even
acceptance: the per-token acceptance a at which the expected tokens of a verification,
1 + a + a^2 + ... + a^k, repay its cost ratio; drafts whose acceptance stays below it lose.

    python tools/verification_cost.py --models smollm2,synthetic:llama-3.2-1b:Q4_K_M
    python tools/verification_cost.py --models smollm2 --batch 1 --drafts 4 --repeats 3   # a smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import label_of, resolve_model  # noqa: E402

from ember_cupy.llm import LLM  # noqa: E402


def break_even_acceptance(cost_ratio: float, num_drafts: int) -> float | None:
    """The acceptance a with sum_{i=0..k} a^i == cost_ratio (None: not reachable, even at a = 1)."""
    if cost_ratio > num_drafts + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        expected = sum(middle ** i for i in range(num_drafts + 1))
        low, high = (middle, high) if expected < cost_ratio else (low, middle)
    return (low + high) / 2


def step_seconds(runner, num_tokens: int, repeats: int) -> float:
    runner.time_forward(num_tokens)   # warm: workspaces of this size
    return statistics.median(runner.time_forward(num_tokens) for _ in range(repeats))


def measure(spec: str, batches: list[int], drafts: list[int], repeats: int) -> dict:
    largest = max(batches) * (1 + max(drafts))
    llm = LLM(resolve_model(spec), max_num_batched_tokens=max(512, largest))
    runner = llm.engine.runner
    rows = []
    for batch in batches:
        plain = step_seconds(runner, batch, repeats)
        for k in drafts:
            verifying = step_seconds(runner, batch * (1 + k), repeats)
            ratio = verifying / plain
            rows.append({"batch": batch, "drafts": k, "plain_ms": plain * 1e3, "verify_ms": verifying * 1e3,
                         "cost_ratio": ratio, "break_even_acceptance": break_even_acceptance(ratio, k)})
    return {"model": label_of(spec), "rows": rows}


def render(results: list[dict]) -> str:
    lines = ["| model | B | k | B decodes ms | B x (1 + k) rows ms | cost ratio | break-even acceptance |",
             "|---|---|---|---|---|---|---|"]
    for result in results:
        for r in result["rows"]:
            even = "never" if r["break_even_acceptance"] is None else f"{r['break_even_acceptance']:.2f}"
            lines.append(f"| {result['model']} | {r['batch']} | {r['drafts']} | {r['plain_ms']:.1f} | "
                         f"{r['verify_ms']:.1f} | {r['cost_ratio']:.2f} | {even} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2", help="comma list: paths, smollm2, synthetic:<shape>:<type>")
    ap.add_argument("--batch", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16])
    ap.add_argument("--drafts", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=7, help="timed passes per size (their median)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = [measure(spec, args.batch, args.drafts, args.repeats) for spec in args.models.split(",")]
    print(render(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
