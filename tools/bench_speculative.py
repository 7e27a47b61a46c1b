"""Speculative decoding on versus off, through HTTP, in one run (issue 27).

One server started with --speculative-config (spawned, or --url); the "off" requests carry
`"speculative": false`, so both arms share the process, its warm caches and its measured step
costs, and run one after the other at each concurrency, --repeats pairs of them with the order
alternating (on two cores one pair's ratio swings by up to +-10% with identical work: the tool
pools the repeats). The spawned server runs without prefix caching: both arms send the same
prompts, and the first arm would pay every prefill the others find cached (grounded c1 paid
18-27% for it). Greedy, EOS honoured: speculation is exact, so both arms generate the same tokens
and their tok/s compare like for like.

Workloads:
  grounded: the output copies spans of the prompt: rewrite a paragraph of the docs, add a docstring
            to a function of this repository's source (prompt lookup's case);
  free:     open-ended writing (where drafts seldom match: the gate must keep this at ~1x).

    python tools/bench_speculative.py --out spec.json                  # c1, c4, c16, both workloads
    python tools/bench_speculative.py --concurrency 1 --max-seconds 10 --num-requests 2 --repeats 1   # a smoke run

Output JSON, per workload and concurrency: each arm's runs (bench_serving's summary, with the
run's speculation counts from /metrics: drafts, drafted and accepted tokens, the acceptance rate
and per draft position), its pooled output tok/s, the pooled ratio on/off and each pair's, and
the "on" arm's acceptance rate over all its runs.
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import json
import math
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import build_payload, run_benchmark, summarize  # noqa: E402
from server_under_test import add_server_arguments, read_samples, served, served_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
TOPICS = ("a lighthouse keeper", "a city under the sea", "the first winter on Mars", "a talking clock",
          "a chess tournament", "a lost letter", "a river that flows uphill", "an old bridge")
SPEC_METRICS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                "vllm:spec_decode_num_accepted_tokens_total")


def readme_paragraphs(limit: int) -> list[str]:
    """Prose paragraphs of the user docs (README.md, then docs/*.md; no code, tables or headings),
    200-900 characters."""
    text = "\n\n".join(path.read_text() for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
    return [p for p in paragraphs if 200 <= len(p) <= 900 and not p.startswith(("#", "|", "-"))][:limit]


def source_functions(limit: int) -> list[str]:
    """Short functions of ember_cupy/engine/, without their docstrings."""
    found = []
    for path in sorted((REPO / "ember_cupy" / "engine").glob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and 6 <= node.end_lineno - node.lineno <= 25:
                lines = source.splitlines()[node.lineno - 1:node.end_lineno]
                body = "\n".join(lines)
                if ast.get_docstring(node):
                    body = re.sub(r'\n\s*"""(.|\n)*?"""', "", body, count=1)
                found.append(body)
    return found[:limit]


def grounded_prompts(count: int) -> list[str]:
    texts = [f"Rewrite the following text, fixing any mistakes and keeping everything else the same.\n\n"
             f"Text: {p}\n\nRewritten text:" for p in readme_paragraphs(count)]
    texts += [f"Add a one-line docstring to this Python function and return the whole function.\n\n"
              f"```python\n{f}\n```\n\nThe function with its docstring:\n```python\n" for f in source_functions(count)]
    return [texts[i % len(texts)] for i in range(count)]


def free_prompts(count: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]}.\n\nStory:" for i in range(count)]


def spec_counts(url: str) -> dict:
    values: dict = {name: 0.0 for name in SPEC_METRICS}
    per_position: dict[int, float] = {}
    for name, labels, value in read_samples(url):
        if name in values:
            values[name] += value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            position = int(labels["position"])
            per_position[position] = per_position.get(position, 0.0) + value
    values["per_position"] = [per_position[p] for p in sorted(per_position)]
    return values


def counts_between(before: dict, after: dict) -> dict:
    drafts, drafted, accepted = (after[n] - before[n] for n in SPEC_METRICS)
    per_position = [a - b for a, b in zip(after["per_position"], before["per_position"] or [0] * 99)]
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "acceptance_per_position": [n / drafts if drafts else None for n in per_position]}


async def run_arm(url: str, model: str, prompts: list[str], args, concurrency: int, speculative: bool) -> dict:
    payloads = [build_payload(model, p, args.max_tokens, extra={"ignore_eos": False, "speculative": speculative})
                for p in prompts]
    before = spec_counts(url)
    results, duration = await run_benchmark(url, payloads, concurrency, max_seconds=args.max_seconds,
                                            timeout=args.timeout)
    summary = summarize(results, duration)
    summary["speculation"] = counts_between(before, spec_counts(url))
    return summary


async def bench(url: str, args) -> dict:
    model = served_model(url)
    report = {"config": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
                         if k != "out"} | {"model": model}, "workloads": {}}
    workloads = {"grounded": grounded_prompts, "free": free_prompts}
    # unrecorded: the first requests of a fresh server run cold, and would count against one arm
    for speculative in (False, True):
        await run_arm(url, model, workloads[args.workloads[0]](2), args, 2, speculative)
    for name in args.workloads:
        rows = report["workloads"][name] = {}
        for concurrency in args.concurrency:
            prompts = workloads[name](args.num_requests or 2 * concurrency)
            row = rows[f"c{concurrency}"] = await compare_arms(url, model, prompts, args, concurrency)
            rate = row["acceptance_rate"]
            spread = "/".join(f"{r:.2f}" for r in row["ratios"])
            print(f"{name:9s} c{concurrency:<3d} off {row['off_tok_per_s']:7.1f} tok/s   "
                  f"on {row['on_tok_per_s']:7.1f} tok/s   x{row['ratio'] or 0:.2f} ({spread})   "
                  f"acceptance {'-' if rate is None else f'{rate:.2f}'}", flush=True)
    return report


async def compare_arms(url: str, model: str, prompts: list[str], args, concurrency: int) -> dict:
    """args.repeats pairs of arms, the order alternating (off/on, on/off, ...): a drifting machine
    or a warming process favours neither arm. Each arm's tok/s pools its repeats (all tokens over
    all time); ratios lists each pair's own."""
    arms: dict[str, list[dict]] = {"off": [], "on": []}
    for repeat in range(args.repeats):
        order = ("off", "on") if repeat % 2 == 0 else ("on", "off")
        for arm in order:
            arms[arm].append(await run_arm(url, model, prompts, args, concurrency, speculative=arm == "on"))
    pooled = {arm: sum(s["total_output_tokens"] for s in runs) / sum(s["duration_s"] for s in runs)
              for arm, runs in arms.items()}
    ratios = [on["output_tok_per_s"] / off["output_tok_per_s"] if off["output_tok_per_s"] else math.nan
              for off, on in zip(arms["off"], arms["on"])]
    drafted = sum(s["speculation"]["draft_tokens"] for s in arms["on"])
    accepted = sum(s["speculation"]["accepted_tokens"] for s in arms["on"])
    return {"off": arms["off"], "on": arms["on"], "off_tok_per_s": pooled["off"], "on_tok_per_s": pooled["on"],
            "acceptance_rate": accepted / drafted if drafted else None,
            "ratio": pooled["on"] / pooled["off"] if pooled["off"] else None, "ratios": ratios,
            "failed": sum(s["failed"] for runs in arms.values() for s in runs)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_arguments(ap, "--no-enable-prefix-caching")
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC,
                    help=f"the spawned server's (default {DEFAULT_SPEC!r}; a draft model: "
                         '\'{"model": PATH, "num_speculative_tokens": 4}\')')
    ap.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 4, 16],
                    help="comma-separated (default 1,4,16)")
    ap.add_argument("--workloads", type=lambda s: s.split(","), default=["grounded", "free"])
    ap.add_argument("--num-requests", type=int, default=None, help="per arm (default: 2 x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="pairs of arms per cell, order alternating")
    ap.add_argument("--max-seconds", type=float, default=math.inf, help="per arm: stop sending after this")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    server_args = shlex.split(args.server_args) + ["--speculative-config", args.speculative_config]
    with served(args.url, server_args, args.server_log) as server:
        report = asyncio.run(bench(server.url, args))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
