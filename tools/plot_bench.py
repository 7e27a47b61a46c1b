"""Turn tools/bench_vs_llamacpp.py's results.json into the BENCHMARKS.md section and PNG plots.

    python tools/plot_bench.py benchmarks/results.json --markdown BENCHMARKS.md

The generated section sits between two HTML comments and is replaced on every run; prose outside
them (analysis, notes) is kept. matplotlib is optional: without it the plots are skipped, noted.
Ratios are ember-cupy / peer: above 1 is better for tok/s, below 1 is better for latencies.
"""

import argparse
import json
import os
import re
from pathlib import Path

BEGIN, END = "<!-- bench_vs_llamacpp:begin -->", "<!-- bench_vs_llamacpp:end -->"
EMBER = "ember-cupy"
ROWS = [("output tok/s", ("output_tok_per_s",)), ("request/s", ("request_per_s",)),
        *[(f"TTFT p{q} (ms)", ("ttft_ms", f"p{q}")) for q in (50, 90, 99)],
        *[(f"TPOT p{q} (ms)", ("tpot_ms", f"p{q}")) for q in (50, 90, 99)],
        *[(f"ITL p{q} (ms)", ("itl_ms", f"p{q}")) for q in (50, 99)],
        *[(f"E2E p{q} (ms)", ("e2e_ms", f"p{q}")) for q in (50, 99)]]


def dig(d, path):
    for key in path:
        d = None if d is None else d.get(key)
    return d


def fmt(x, digits=1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def servers_of(results) -> list[str]:
    for w in results["workloads"]:
        return list(w["median"])
    return list(results.get("single_stream") or {})


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(r) + " |" for r in rows]]


def peers_header(names):
    peers = [n for n in names if n != EMBER]
    return peers, [*names, *[f"{EMBER} / {p}" for p in peers]]


def workload_section(w: dict) -> list[str]:
    cfg, med = w["workload"], w["median"]
    names = list(med)
    peers, header = peers_header(names)
    prefix = f", shared prefix {cfg['shared_prefix']} words" if cfg["shared_prefix"] else ""
    rate = f", Poisson {cfg['request_rate']} req/s" if cfg["request_rate"] != "inf" else ""
    lines = [f"### {cfg['name']}", "",
             f"Concurrency {cfg['concurrency']}{rate}, {cfg['num_requests']} requests, prompts "
             f"{cfg['prompt_min']}-{cfg['prompt_max']} words{prefix}, {cfg['max_tokens']} output tokens.", ""]
    rows = [["ok / failed", *[f"{fmt(med[n]['completed'], 0)} / {fmt(med[n]['failed'], 0)}" for n in names],
             *["" for _ in peers]]]
    for label, path in ROWS:
        vals = [dig(med[n], path) for n in names]
        rows.append([label, *[fmt(v, 3 if label == "request/s" else 1) for v in vals],
                     *[ratio(vals[0], dig(med[p], path)) for p in peers]])
    lines += table(["metric", *header], rows) + [""]
    idle = [r["idle"] for runs in w["runs"].values() for r in runs]
    lines += [f"CPU idle before each run: min {min(idle):.2f}; load avg max "
              f"{max(r['loadavg1'] for runs in w['runs'].values() for r in runs):.2f}.", "",
              "<details><summary>server commands</summary>", ""]
    lines += [f"- {name}: `{cmd}`" for name, cmd in w["commands"].items()] + ["", "</details>", ""]
    return lines


def summary_section(results) -> list[str]:
    names = servers_of(results)
    peers, header = peers_header(names)
    rows = []
    for w in results["workloads"]:
        vals = [w["median"][n]["output_tok_per_s"] for n in names]
        rows.append([w["workload"]["name"], *[fmt(v) for v in vals],
                     *[ratio(vals[0], w["median"][p]["output_tok_per_s"]) for p in peers]])
    return ["### Output tok/s, all workloads", ""] + table(["workload", *header], rows) + [""]


def targets_section(results) -> list[str]:
    by = {w["workload"]["name"]: w["median"] for w in results["workloads"]}
    lines = ["### Targets (issue 5)", ""]
    for name, path, goal in (("c16", ("output_tok_per_s",), ">= 1.5x"),
                             ("c32", ("output_tok_per_s",), ">= 1.5x"),
                             ("c16", ("ttft_ms", "p50"), "<= 1.0x")):
        if name not in by:
            continue
        med = by[name]
        got = ", ".join(f"{ratio(dig(med[EMBER], path), dig(med[p], path))} vs {p}"
                        for p in med if p != EMBER)
        what = "output tok/s" if path[0] == "output_tok_per_s" else "TTFT p50"
        lines.append(f"- {what} at {name}: ember-cupy {fmt(dig(med[EMBER], path))}; {got} (target {goal})")
    ss = results.get("single_stream") or {}
    if EMBER in ss:
        peers = ", ".join(f"{p} {fmt(v['decode_tok_per_s'])} tok/s" for p, v in ss.items() if p != EMBER)
        lines.append(f"- single-stream decode: ember-cupy {fmt(ss[EMBER]['decode_tok_per_s'])} tok/s "
                     f"(TPOT {fmt(ss[EMBER]['decode_tpot_ms'], 2)} ms); {peers}")
    return lines + [""]


def single_stream_section(ss: dict) -> list[str]:
    rows = [[n, fmt(v["decode_tpot_ms"], 2), fmt(v["decode_tok_per_s"]), fmt(v["prefill_tok_per_s"]),
             fmt(v["prefill_ttft_ms"])] for n, v in ss.items()]
    cfg = next(iter(ss.values())).get("setup", {})
    lines = ["### Single stream", "",
             f"One request at a time, {cfg.get('requests')} requests each. Decode: {cfg.get('decode_prompt')}-token "
             f"prompts, {cfg.get('decode_tokens')} tokens (TPOT p50). Prefill: {cfg.get('prefill_prompt')}-token "
             "prompts, max_tokens 1, prompt tokens / TTFT (median; includes the HTTP round trip).", ""]
    lines += table(["server", "decode TPOT (ms)", "decode tok/s", "prefill tok/s", "prefill TTFT (ms)"], rows)
    return lines + ["", "<details><summary>server commands</summary>", "",
                    *[f"- {n}: `{v['command']}`" for n, v in ss.items()], "", "</details>", ""]


def render(results: dict, plots: list[str], plot_note: str) -> str:
    m, mach = results["meta"], results["meta"]["machine"]
    dirty = " (with uncommitted changes in ember_cupy/)" if mach.get("ember_dirty") else ""
    lines = [BEGIN, f"## ember-cupy vs llama.cpp: generated {m['finished']} by tools/bench_vs_llamacpp.py", "",
             f"- Machine: {mach['cpu']}, {mach['nproc']} CPUs, {mach['memory']} RAM, Linux {mach['kernel']}; "
             f"Python {mach['python']}, NumPy {mach['numpy']}",
             f"- ember-cupy {mach['ember_commit']}{dirty}; llama-server {m['llama_version']} ({m['llama_server']})",
             f"- Model: `{m['model']}`; peers: " + ", ".join(f"{k} `{v}`" for k, v in m["peers"].items()),
             f"- Command: `{m['argv']}` ({m['started']} to {m['finished']})",
             f"- Medians of {m['repeats']} repeats{' (QUICK smoke run: not a measurement)' if m['quick'] else ''}; "
             "ratios are ember-cupy / peer (tok/s: higher is better; latencies: lower is better).", ""]
    if results["workloads"]:
        lines += targets_section(results) + summary_section(results)
    if results.get("single_stream"):
        lines += single_stream_section(results["single_stream"])
    for w in results["workloads"]:
        lines += workload_section(w)
    for f in results.get("failed", []):
        lines += [f"### {f['workload']}: FAILED", "", "```", f["error"][-800:], "```", ""]
    lines += ["### Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    lines += ([plot_note] if plot_note else []) + ["", END]
    return "\n".join(lines) + "\n"


def splice(path: str, section: str) -> None:
    """Replace the generated section of `path` (or append it; or create the file)."""
    old = Path(path).read_text() if os.path.exists(path) else "# Benchmarks\n\n"
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END) + r"\n?", re.DOTALL)
    new = pattern.sub(lambda _: section, old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + section
    Path(path).write_text(new)


def write_all(results: dict, out_dir: str, markdown: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    pngs, note = make_plots(results, out_dir)
    rel = [os.path.relpath(p, os.path.dirname(os.path.abspath(markdown))) for p in pngs]
    splice(markdown, render(results, rel, note))
    print(f"wrote {markdown}, {out_dir}/results.json" + (f", {len(pngs)} plots" if pngs else "")
          + (f" ({note})" if note else ""))


# ---------------------------------------------------------------- plots (matplotlib optional)

def make_plots(results: dict, out_dir: str) -> tuple[list[str], str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "_Plots skipped: matplotlib is not installed (`pip install matplotlib`, then rerun tools/plot_bench.py)._"
    if not results["workloads"]:
        return [], ""
    paths = [_throughput_plot(plt, results, out_dir)]
    paths += [_percentile_plot(plt, results, out_dir, key, label)
              for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"))]
    return [p for p in paths if p], ""


def _throughput_plot(plt, results, out_dir):
    closed = [w for w in results["workloads"] if re.fullmatch(r"c\d+", w["workload"]["name"])]
    if not closed:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in servers_of(results):
        xs = [w["workload"]["concurrency"] for w in closed]
        runs = [[r["output_tok_per_s"] for r in w["runs"][name]] for w in closed]
        ys = [w["median"][name]["output_tok_per_s"] for w in closed]
        err = [[y - min(r) for y, r in zip(ys, runs)], [max(r) - y for y, r in zip(ys, runs)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
    ax.set(xscale="log", xlabel="concurrent streams", ylabel="output tok/s",
           title="Throughput vs concurrency (median, min-max)")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, out_dir, "throughput_vs_concurrency.png")


def _percentile_plot(plt, results, out_dir, key, label):
    names, wls = servers_of(results), results["workloads"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    width = 0.8 / len(names)
    for ax, q in zip(axes, ("p50", "p90", "p99")):
        for i, name in enumerate(names):
            ys = [w["median"][name][key][q] or 0 for w in wls]
            ax.bar([j + i * width for j in range(len(wls))], ys, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(wls))],
                      [w["workload"]["name"] for w in wls], rotation=45, ha="right")
        ax.set(title=f"{label} {q}", yscale="log")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel(f"{label} (ms, log)")
    axes[0].legend(fontsize=8)
    return _save(plt, fig, out_dir, f"{label.lower()}_percentiles.png")


def _save(plt, fig, out_dir, name):
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="results.json written by bench_vs_llamacpp.py")
    ap.add_argument("--markdown", default="BENCHMARKS.md")
    ap.add_argument("--out-dir", default=None, help="plots (default: next to results.json)")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    write_all(results, args.out_dir or os.path.dirname(os.path.abspath(args.results)), args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
