"""ember-cupy at one git revision against another (or the working tree), same workloads, same run:
the cost of a change, measured through the HTTP server as users see it.

    python tools/bench_revisions.py --base fdc15ea                  # base vs the working tree
    python tools/bench_revisions.py --base fdc15ea --head main --repeats 3 --out /tmp/ab.json

Each revision is checked out into a temporary git worktree and served with PYTHONPATH pointing at
it (the editable install's finder comes after PYTHONPATH), so both servers run the same
interpreter, libraries, model and flags. Workloads are tools/bench_vs_llamacpp.py's: the
single-stream decode (TPOT of 32-token prompts x 128 tokens) and prefill (prompt tokens / TTFT of
512-token prompts) and the c1/c16 closed loops. Per workload both servers are started, warmed up
and measured in turn, alternating which goes first every repeat, each run waiting for an idle CPU.
Printed: medians and head/base ratios (> 1: head is faster).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_vs_llamacpp as bvl
from bench_machine import machine

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "decode": bvl.Workload("decode", 1, 5, 32, 32, 128),
    "prefill": bvl.Workload("prefill", 1, 5, 512, 512, 1),
    "c1": bvl.Workload("c1", 1, 8),
    "c16": bvl.Workload("c16", 16, 48),
    "c16-sampled": bvl.Workload("c16-sampled", 16, 48, **bvl.SAMPLED),
}


@contextmanager
def checkout(rev: str | None):
    """A directory holding `rev` (None: the working tree itself)."""
    if rev is None:
        yield ROOT
        return
    with tempfile.TemporaryDirectory(prefix="ember-rev-") as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
                       check=True, capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                           capture_output=True)


def server_for(tree: Path, label: str, w: bvl.Workload, args):
    server = bvl.ember_server(args.model, w, args)
    server.name = label
    server.env = {**server.env, "PYTHONPATH": str(tree)}
    server.log = Path(args.log_dir) / f"{label.replace('/', '_')}-{w.name}.log"
    return server


def headline(w: bvl.Workload, summary: dict, results: list) -> float | None:
    """The number a workload is judged by: decode tok/s (1000 / TPOT p50), prefill tok/s (prompt
    tokens / TTFT, median over requests), or aggregate output tok/s."""
    if w.name == "decode":
        tpot = summary["tpot_ms"]["p50"]
        return 1000 / tpot if tpot else None
    if w.name == "prefill":
        rates = [r.prompt_tokens / r.ttft for r in results if r.ok and r.prompt_tokens and r.ttft]
        return statistics.median(rates) if rates else None
    return summary["output_tok_per_s"]


def run_workload(w: bvl.Workload, trees: dict, args) -> dict:
    servers = [server_for(tree, label, w, args) for label, tree in trees.items()]
    values = {s.name: [] for s in servers}
    failed = {s.name: 0 for s in servers}
    try:
        for s in servers:
            s.start()
            bvl.warm_up(s, w)
        for rep in range(args.repeats):
            order = servers[rep % 2:] + servers[:rep % 2]
            for s in order:
                summary, results = bvl.measure(s, w, args.seed + rep, args)
                values[s.name].append(headline(w, summary, results))
                failed[s.name] += summary["failed"]
    finally:
        for s in servers:
            s.stop()
    medians = {k: statistics.median(v) for k, v in values.items() if None not in v}
    return {"workload": w.name, "values": values, "median": medians, "failed": failed}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision measured as the baseline")
    ap.add_argument("--head", default=None, help="git revision to compare (default: the working tree)")
    ap.add_argument("--model", default=bvl.default_model())
    ap.add_argument("--workloads", default="decode,prefill,c1,c16",
                    help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--out", default=None, help="JSON results")
    bvl.add_measurement_arguments(ap)
    args = ap.parse_args(argv)
    args.kv_capacity = "default"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    chosen = [WORKLOADS[n.strip()] for n in args.workloads.split(",") if n.strip()]
    os.makedirs(args.log_dir, exist_ok=True)
    base_label, head_label = f"base@{args.base}", f"head@{args.head or 'worktree'}"
    results = {"meta": {"argv": sys.argv, "machine": machine(), "model": args.model,
                        "base": args.base, "head": args.head or "working tree",
                        "ember_args": args.ember_args, "repeats": args.repeats}, "workloads": []}
    with checkout(args.base) as base, checkout(args.head) as head:
        trees = {base_label: base, head_label: head}
        for w in chosen:
            print(f"workload {w.name}", flush=True)
            row = run_workload(w, trees, args)
            m = row["median"]
            row["ratio"] = (m[head_label] / m[base_label]
                            if m.get(head_label) and m.get(base_label) else None)
            results["workloads"].append(row)
            print(f"  {w.name}: base {m.get(base_label)}, head {m.get(head_label)}, "
                  f"head/base {row['ratio']}, failed {row['failed']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 1 if any(sum(r["failed"].values()) for r in results["workloads"]) else 0


if __name__ == "__main__":
    sys.exit(main())
