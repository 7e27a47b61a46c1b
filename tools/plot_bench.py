"""Turn tools/bench_vs_llamacpp.py's results.json into the BENCHMARKS.md section and PNG plots.

    python tools/plot_bench.py benchmarks/results.json --markdown BENCHMARKS.md

The generated section sits between two HTML comments and is replaced on every run; prose outside
them (analysis, notes) is kept. matplotlib is optional: without it the plots are skipped, noted.
Ratios are ember-cupy / peer: above 1 is better for tok/s, below 1 is better for latencies.
The targets (issue 10) are against the llama.cpp-Q4_1 peer of the same run.
"""

import argparse
import json
import os
import re
from pathlib import Path

BEGIN, END = "<!-- bench_vs_llamacpp:begin -->", "<!-- bench_vs_llamacpp:end -->"
EMBER = "ember-cupy"
TARGET_PEER = "llama.cpp-Q4_1"
RSS_SLACK_MB = 150.0
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


def sampling_text(cfg: dict) -> str:
    if not cfg.get("temperature"):
        return "greedy"
    extra = "".join(f", {k} {cfg[k]}" for k in ("top_p", "top_k") if cfg.get(k) is not None)
    return f"sampled: temperature {cfg['temperature']}{extra}"


def peak_rss(w: dict, name: str, key: str = "peak_rss_mb"):
    """The highest `key` of `name`'s resident memory over the repeats of workload `w` (MB)."""
    vals = [dig(r, ("rss", key)) for r in w["runs"].get(name, [])]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def totals(w: dict, name: str) -> tuple[int, int]:
    """(ok, failed) requests of `name` summed over all repeats of `w`."""
    runs = w["runs"].get(name, [])
    return sum(r["completed"] for r in runs), sum(r["failed"] for r in runs)


def workload_section(w: dict) -> list[str]:
    cfg, med = w["workload"], w["median"]
    names = list(med)
    peers, header = peers_header(names)
    prefix = f", shared prefix {cfg['shared_prefix']} words" if cfg["shared_prefix"] else ""
    rate = f", Poisson {cfg['request_rate']} req/s" if cfg["request_rate"] != "inf" else ""
    ctx = (f" llama-server slot context {w['slot_context']} tokens (longest prompt "
           f"{w['max_prompt_tokens'] if w.get('max_prompt_tokens') else 'estimated'} tokens)."
           if w.get("slot_context") else "")
    reported = {n: v for n, v in (w.get("server_slot_context") or {}).items() if v}
    ctx += (" Slot context reported by " + ", ".join(f"{n}: {v}" for n, v in reported.items()) + "."
            if reported else "")
    lines = [f"### {cfg['name']}", "",
             f"Concurrency {cfg['concurrency']}{rate}, {cfg['num_requests']} requests, prompts "
             f"{cfg['prompt_min']}-{cfg['prompt_max']} words{prefix}, {cfg['max_tokens']} output tokens, "
             f"{sampling_text(cfg)}.{ctx}", ""]
    rows = [["ok / failed (all repeats)", *[f"{totals(w, n)[0]} / {totals(w, n)[1]}" for n in names],
             *["" for _ in peers]]]
    for label, path in ROWS:
        vals = [dig(med[n], path) for n in names]
        rows.append([label, *[fmt(v, 3 if label == "request/s" else 1) for v in vals],
                     *[ratio(vals[0], dig(med[p], path)) for p in peers]])
    for label, key in (("peak RSS (MB)", "peak_rss_mb"), ("VmHWM (MB)", "hwm_mb")):
        vals = [peak_rss(w, n, key) for n in names]
        if any(v is not None for v in vals):
            rows.append([label, *[fmt(v, 0) for v in vals],
                         *[ratio(vals[0], peak_rss(w, p, key)) for p in peers]])
    lines += table(["metric", *header], rows) + [""]
    lines += failure_lines(w)
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


def failure_lines(w: dict) -> list[str]:
    """Every error text of the workload's failed requests, per server, with counts, and the
    server's own log lines about them."""
    lines = []
    for name, runs in w["runs"].items():
        for i, r in enumerate(runs):
            counts = r.get("error_counts")
            if counts is None:   # results.json from before error_counts: texts only
                errors = r.get("errors", [])
                counts = {errors[0]: r["failed"]} if len(errors) == 1 else {e: "?" for e in errors}
            for err, n in counts.items():
                lines.append(f"- FAILED: {name}, repeat {i + 1}: {n} x `{err}`")
            lines += [f"  - {name} log: `{ln}`" for ln in r.get("server_log", [])[-5:]]
    return (["Failed requests:", "", *lines, ""]) if lines else []


def failed_requests(results) -> dict:
    """{server: failed requests over every workload, repeat and the single-stream runs}."""
    out = {}
    for w in results["workloads"]:
        for name in w["runs"]:
            out[name] = out.get(name, 0) + totals(w, name)[1]
    for name, v in (results.get("single_stream") or {}).items():
        out[name] = out.get(name, 0) + (v.get("failed") or 0)
    return out


def _target(what, ember, peer, value, goal, met, stretch=None) -> dict:
    status = "not measured" if met is None else ("met" if met else "missed")
    if stretch is not None and met is not None:
        status += f"; stretch {stretch[0]} {'met' if stretch[1] else 'missed'}"
    return {"target": what, "ember": ember, "peer": peer, "value": value, "goal": goal, "status": status}


def targets(results) -> tuple[str, list[dict]]:
    """The issue-10 targets, each against the llama.cpp-Q4_1 peer (else the first peer)."""
    names = servers_of(results)
    others = [n for n in names if n != EMBER]
    peer = TARGET_PEER if TARGET_PEER in names else (others[0] if others else TARGET_PEER)
    by = {w["workload"]["name"]: w for w in results["workloads"]}
    tok = lambda name, who: dig(by.get(name, {}).get("median", {}).get(who), ("output_tok_per_s",))  # noqa: E731
    rows = []

    def versus(what, e, p, goal, stretch=None, digits=1):
        r = e / p if e is not None and p else None
        met = None if r is None else r >= goal
        rows.append(_target(what, fmt(e, digits), fmt(p, digits), "-" if r is None else f"{r:.2f}x",
                            f">= {goal:.1f}x" + (f" (stretch {stretch:.1f}x)" if stretch else ""), met,
                            None if stretch is None or r is None else (f"{stretch:.1f}x", r >= stretch)))

    ss = results.get("single_stream") or {}
    versus("single-stream decode tok/s", dig(ss.get(EMBER), ("decode_tok_per_s",)),
           dig(ss.get(peer), ("decode_tok_per_s",)), 1.0, stretch=1.3)
    setup = next(iter(ss.values()), {}).get("setup", {}) if ss else {}
    versus(f"prefill tok/s, {setup.get('prefill_prompt', 512)}-token prompt",
           dig(ss.get(EMBER), ("prefill_tok_per_s",)), dig(ss.get(peer), ("prefill_tok_per_s",)), 1.5)
    for name, goal in (("c4", 1.3), ("c16", 2.0), ("c32", 2.0)):
        versus(f"output tok/s at {name}", tok(name, EMBER), tok(name, peer), goal)

    greedy, sampled = tok("c16", EMBER), tok("c16-sampled", EMBER)
    r = sampled / greedy if sampled is not None and greedy else None
    pg, ps = tok("c16", peer), tok("c16-sampled", peer)
    rows.append(_target("sampled c16 vs greedy c16 (ember-cupy)", f"{fmt(sampled)} / {fmt(greedy)}",
                        f"{fmt(ps)} / {fmt(pg)}" + (f" = {ps / pg:.2f}x" if ps is not None and pg else ""),
                        "-" if r is None else f"{r:.2f}x", ">= 0.90x (within 10%)",
                        None if r is None else r >= 0.90))

    e_rss, p_rss = (peak_rss(by["c16"], EMBER), peak_rss(by["c16"], peer)) if "c16" in by else (None, None)
    diff = e_rss - p_rss if e_rss is not None and p_rss is not None else None
    rows.append(_target("peak RSS through c16 (MB)", fmt(e_rss, 0), fmt(p_rss, 0),
                        "-" if diff is None else f"{diff:+.0f} MB", f"<= {peer} + {RSS_SLACK_MB:.0f} MB",
                        None if diff is None else diff <= RSS_SLACK_MB))

    failed = failed_requests(results)
    rows.append(_target("failed requests, all workloads", fmt(failed.get(EMBER), 0), fmt(failed.get(peer), 0),
                        "-", "0 on both", None if not failed else failed.get(EMBER, 0) + failed.get(peer, 0) == 0))
    return peer, rows


def target_lines(results) -> list[str]:
    peer, rows = targets(results)
    return [f"Targets (issue 10), ember-cupy vs {peer}:"] + [
        f"- {t['target']}: ember-cupy {t['ember']}, {peer} {t['peer']}, ratio {t['value']} "
        f"(target {t['goal']}): {t['status'].upper()}" for t in rows]


def targets_section(results) -> list[str]:
    peer, rows = targets(results)
    lines = [f"### Targets (issue 10), against {peer} in this run", ""]
    lines += table(["target", EMBER, peer, "ratio", "goal", "status"],
                   [[t["target"], t["ember"], t["peer"], t["value"], t["goal"],
                     f"**{t['status']}**"] for t in rows])
    return lines + ["", "Peak RSS: the highest summed VmRSS of the server's process tree sampled every "
                    "0.25 s through every c16 repeat (VmHWM in the c16 table).", ""]


def single_stream_section(ss: dict) -> list[str]:
    rows = [[n, fmt(v["decode_tpot_ms"], 2), fmt(v["decode_tok_per_s"]), fmt(v["prefill_tok_per_s"]),
             fmt(v["prefill_ttft_ms"]), fmt(v.get("failed"), 0)] for n, v in ss.items()]
    cfg = next(iter(ss.values())).get("setup", {})
    lines = ["### Single stream", "",
             f"One request at a time, {cfg.get('requests')} requests each. Decode: {cfg.get('decode_prompt')}-token "
             f"prompts, {cfg.get('decode_tokens')} tokens (TPOT p50). Prefill: {cfg.get('prefill_prompt')}-token "
             "prompts, max_tokens 1, prompt tokens / TTFT (median; includes the HTTP round trip).", ""]
    lines += table(["server", "decode TPOT (ms)", "decode tok/s", "prefill tok/s", "prefill TTFT (ms)",
                    "failed"], rows)
    errors = [f"- FAILED: {n}: {c} x `{e}`" for n, v in ss.items() for e, c in (v.get("error_counts") or {}).items()]
    lines += ["", *errors] if errors else []
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
             f"- Command: `{m['argv']}` ({m['started']} to {m['finished']}"
             + (f"; estimated {m['estimate_s'] / 60:.0f} min" if m.get("estimate_s") else "")
             + (f", took {m['elapsed_s'] / 60:.0f} min" if m.get("elapsed_s") else "") + ")",
             *([f"- Client: one TCP connection per request (no keep-alive); llama-server's slot context "
                f"from prompt token counts by {m['context_sizing']}"] if m.get("context_sizing") else []),
             *(["- KV capacity: ember-cupy's pool holds as many tokens as llama-server's -c of the same workload "
                "(`--num-kv-blocks`), so peak RSS compares equal KV capacity"] if m.get("kv_capacity") == "llama" else []),
             f"- Medians of {m['repeats']} repeats{' (QUICK smoke run: not a measurement)' if m['quick'] else ''}; "
             "ratios are ember-cupy / peer (tok/s: higher is better; latencies: lower is better).", ""]
    if results["workloads"] or results.get("single_stream"):
        lines += targets_section(results)
    if results["workloads"]:
        lines += summary_section(results)
    if results.get("single_stream"):
        lines += single_stream_section(results["single_stream"])
    for w in results["workloads"]:
        lines += workload_section(w)
    for f in results.get("failed", []):
        lines += [f"### {f['workload']}: FAILED", "", "```", f["error"][-800:], "```", ""]
    lines += ["### Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    lines += ([plot_note] if plot_note else []) + ["", END]
    return "\n".join(lines) + "\n"


def splice(path: str, section: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the generated section of `path` between `begin` and `end` (or append it; or
    create the file)."""
    old = Path(path).read_text() if os.path.exists(path) else "# Benchmarks\n\n"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end) + r"\n?", re.DOTALL)
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
