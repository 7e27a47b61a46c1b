"""A model matrix: ember-cupy vs llama.cpp's llama-server on several GGUFs, the same rows for each.

    python tools/bench_models.py --models all-synthetic                   # every shape x type (long)
    python tools/bench_models.py --models synthetic:llama-3.2-1b:Q4_K_M,synthetic:qwen2.5-0.5b:Q8_0
    python tools/bench_models.py --models /path/model.gguf --rows single,c8 --repeats 3
    python tools/bench_models.py --models synthetic:tiny:Q8_0 --rows single --max-seconds 20   # smoke

--models: comma list of GGUF paths, `smollm2` (the shipped SmolLM2 Q4_1), `synthetic:<shape>:<type>`
(tools/make_synthetic_gguf.py; written first when missing, which takes minutes for the big shapes),
and `all-synthetic` (every shape but tiny x Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0). Rows per model:

  single      c1: TPOT p50 of 4 requests, 32-token prompts, 64 tokens out (ignore_eos), one at a
              time, both servers up and taking turns request by request (a drift of the VM's
              speed then falls on both); its % of the bandwidth floor = (weight bytes read per token / read bandwidth)
              / TPOT, with the bandwidth of a STREAM-like probe of this run (bench_machine.
              read_bandwidth, at the start and the end; the higher is used), once for the file's
              bytes (the same floor for both) and once for the bytes each engine serves (ember-cupy's
              /version weight_bytes: it requantizes K-quants to Q8_0 on the CPU); and prefill: prompt
              tokens / TTFT of 512-token prompts x 1 token (median of 4). Also each server's load
              time: start to the first healthy /health, page cache warm; ember-cupy's weight cache
              (ember_cupy/model/weight_cache.py) is a fresh folder per model, so its first start
              packs the weights into it and the later starts (each further row group) map them:
              rows "load (s), first start" and "load (s), later starts" (their median).
  c8, c16     output tok/s, 8 / 16 in flight (16 / 32 requests, prompts 32-256 words, 64 tokens out)
  c8-sampled  c8 with llama.cpp's default sampler settings (temperature 0.8, top_p 0.95, top_k 40)

plus each server's peak RSS over all rows and its failed requests (the run fails unless 0 on both
sides). The rows are bench_vs_llamacpp.single_stream and run_workload: the same server flags
(llama-server: -np = concurrency, 2 threads, built without AMX: see tools/llamacpp.py), idle waits
and RSS sampling. Ratios are ember-cupy / llama.cpp. Results: --out-dir/models.json (after every
model: results.partial.json) and the section of --markdown between the bench_models markers.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_vs_llamacpp as bv
import llamacpp
import make_synthetic_gguf as synth
import plot_bench
from bench_machine import machine, read_bandwidth
from bench_vs_llamacpp import SAMPLED, Workload

EMBER, PEER = "ember-cupy", "llama.cpp"
BEGIN, END = "<!-- bench_models:begin -->", "<!-- bench_models:end -->"
DECODE = Workload("c1", 1, 4, 32, 32, 64)
PREFILL = Workload("prefill-512", 1, 4, 512, 512, 1)
WORKLOADS = {"c8": Workload("c8", 8, 16, 32, 256, 64), "c16": Workload("c16", 16, 32, 32, 256, 64),
             "c8-sampled": Workload("c8-sampled", 8, 16, 32, 256, 64, **SAMPLED)}
ROW_GROUPS = ("single", *WORKLOADS)
ALL_SYNTHETIC = "all-synthetic"


# ---------------------------------------------------------------- which models

def expand_models(text: str) -> list[str]:
    """The --models list with `all-synthetic` expanded, duplicates dropped, specs checked."""
    specs = []
    for item in (t.strip() for t in text.split(",")):
        if item == ALL_SYNTHETIC:
            specs += [f"{synth.SPEC_PREFIX}{shape}:{qtype}" for shape in synth.shape_names("all")
                      for qtype in synth.DEFAULT_TYPES]
        elif item:
            if item.startswith(synth.SPEC_PREFIX):
                synth.parse_spec(item)   # raises on a bad spec before any model runs
            specs.append(item)
    return list(dict.fromkeys(specs))


def resolve_model(spec: str, out_dir: Path = synth.CACHE) -> str:
    """A --models item -> a GGUF path (a synthetic one is written when missing)."""
    if spec == "smollm2":
        return bv.default_model()
    if spec.startswith(synth.SPEC_PREFIX):
        return synth.ensure_synthetic(*synth.parse_spec(spec), out_dir)
    if not os.path.exists(spec):
        raise FileNotFoundError(f"no GGUF at {spec!r}")
    return spec


def label_of(spec: str) -> str:
    return spec.removeprefix(synth.SPEC_PREFIX) if spec.startswith(synth.SPEC_PREFIX) else Path(spec).stem


def parse_rows(text: str) -> list[str]:
    rows = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROW_GROUPS]
    if unknown:
        raise SystemExit(f"unknown row group(s) {', '.join(unknown)}; known: {', '.join(ROW_GROUPS)}")
    return rows


# ---------------------------------------------------------------- the file's bytes

def gguf_facts(path: str) -> dict:
    """File type, bytes, and the weight bytes one decode step reads: every tensor but the
    embedding table, which counts too when it is tied (the LM head reads all of it)."""
    import gguf
    reader = synth.fast_reader(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    tied = "output.weight" not in sizes
    file_type = reader.fields.get("general.file_type")
    ftype = int(file_type.contents()) if file_type is not None else None
    try:
        ftype_name = gguf.LlamaFileType(ftype).name.removeprefix("MOSTLY_") if ftype is not None else None
    except ValueError:
        ftype_name = str(ftype)
    return {"file_type": ftype_name, "file_bytes": os.path.getsize(path), "tensor_bytes": sum(sizes.values()),
            "tied_embeddings": tied, "architecture": reader.fields["general.architecture"].contents(),
            "bytes_per_token": sum(sizes.values()) - (0 if tied else sizes.get("token_embd.weight", 0))}


def warm_page_cache(path: str, chunk: int = 64 << 20) -> None:
    """Read the file once, so that neither server's load time includes the disk."""
    with open(path, "rb") as f:
        while f.read(chunk):
            pass


# ---------------------------------------------------------------- one model

def model_args(args, label: str, path: str):
    """A copy of args for one model: its GGUF, its own log folder."""
    margs = copy.copy(args)
    margs.model = path
    margs.log_dir = str(Path(args.log_dir) / re.sub(r"[^A-Za-z0-9_.-]+", "_", label))
    return margs


def run_model(spec: str, args) -> dict:
    """Every asked row group of one model; a group whose server fails is recorded, not raised."""
    label = label_of(spec)
    print(f"== model {label}", flush=True)
    t0 = time.monotonic()
    out = {"spec": spec, "label": label, "path": None, "bytes_per_token": None,
           "single": None, "workloads": [], "failed": []}
    try:
        path = resolve_model(spec, Path(args.synthetic_dir))
        out |= {"path": path, **gguf_facts(path)}
    except (RuntimeError, OSError, ValueError) as exc:   # no file, or llama-quantize failed
        print(f"{label}: no model ({exc})", file=sys.stderr, flush=True)
        out["failed"].append({"group": "model", "error": str(exc)[-2000:]})
        return out
    warm_page_cache(path)
    os.environ["EMBER_WEIGHT_CACHE"] = tempfile.mkdtemp(prefix="bench-weight-cache-")   # servers inherit it
    margs = model_args(args, label, path)
    peers, count = {PEER: path}, bv.gguf_token_counter(path)
    for group in args.row_groups:
        try:
            if group == "single":
                out["single"] = bv.single_stream(peers, margs, count, setup=(DECODE, PREFILL))
            else:
                out["workloads"].append(bv.run_workload(WORKLOADS[group], peers, margs, count))
        except (RuntimeError, OSError) as exc:   # a server died or never came up: keep going
            print(f"{label} {group} failed: {exc}", file=sys.stderr, flush=True)
            out["failed"].append({"group": group, "error": str(exc)[-2000:]})
    shutil.rmtree(os.environ.pop("EMBER_WEIGHT_CACHE"), ignore_errors=True)
    out["elapsed_s"] = round(time.monotonic() - t0)
    return out


# ---------------------------------------------------------------- rows (pure)

def floor_percent(bytes_per_token, bandwidth, tpot_ms):
    """100 x (bytes / bandwidth) / TPOT: how close a decode step is to reading its weights once."""
    if not bytes_per_token or not bandwidth or not tpot_ms:
        return None
    return 100.0 * (bytes_per_token / bandwidth * 1000.0) / tpot_ms


def served_bytes(model: dict, name: str):
    """Weight bytes as `name` serves them: ember-cupy's /version weight_bytes (its embedding
    table included, which an untied model reads one row of), the file's for llama.cpp."""
    if name != EMBER:
        return model["bytes_per_token"]
    info = (model.get("single") or {}).get(EMBER, {}).get("server_info") or {}
    return info.get("weight_bytes")


def peak_rss_mb(model: dict, name: str, key: str = "peak_rss_mb"):
    """The highest `key` (peak_rss_mb: sampled while measuring; hwm_mb: VmHWM, the loading
    included) of `name` over all row groups of `model`."""
    single = (model.get("single") or {}).get(name, {})
    vals = [plot_bench.dig(single, ("rss", key))]
    vals += [plot_bench.peak_rss(w, name, key) for w in model["workloads"]]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def load_seconds(model: dict, name: str, later: bool = False):
    """The first start's load time (the single group's, else the first workload's), or with
    `later` the median of the other starts' (None when there was one start)."""
    single = (model.get("single") or {}).get(name) or {}
    times = [single.get("load_s")] + [w.get("load_s", {}).get(name) for w in model["workloads"]]
    times = [t for t in times if t is not None]
    if not later:
        return times[0] if times else None
    return statistics.median(times[1:]) if len(times) > 1 else None


def failed_requests(model: dict, name: str) -> int:
    single = (model.get("single") or {}).get(name, {})
    return int(single.get("failed") or 0) + sum(plot_bench.totals(w, name)[1] for w in model["workloads"])


def row(name: str, better: str, ember, llama) -> dict:
    ratio = ember / llama if isinstance(ember, (int, float)) and llama else None
    return {"row": name, "better": better, EMBER: ember, PEER: llama, "ratio": ratio}


def matrix_rows(model: dict, bandwidth: float) -> list[dict]:
    """The table of one model: {row, better (higher / lower), ember-cupy, llama.cpp, ratio}."""
    single, rows = model.get("single") or {}, []
    if single:
        get = lambda key: [single.get(n, {}).get(key) for n in (EMBER, PEER)]  # noqa: E731
        tpot = get("decode_tpot_ms")
        rows.append(row("c1 TPOT (ms)", "lower", *tpot))
        rows.append(row("c1 % of bandwidth floor, file bytes", "higher",
                        *[floor_percent(model["bytes_per_token"], bandwidth, t) for t in tpot]))
        rows.append(row("c1 % of bandwidth floor, bytes as served", "higher",
                        *[floor_percent(served_bytes(model, n), bandwidth, t) for n, t in zip((EMBER, PEER), tpot)]))
        rows.append(row("prefill 512 (tok/s)", "higher", *get("prefill_tok_per_s")))
    for w in model["workloads"]:
        rows.append(row(f"{w['workload']['name']} output tok/s", "higher",
                        *[plot_bench.dig(w, ("median", n, "output_tok_per_s")) for n in (EMBER, PEER)]))
    rows.append(row("peak RSS (MB)", "lower", peak_rss_mb(model, EMBER), peak_rss_mb(model, PEER)))
    rows.append(row("peak RSS incl. loading, VmHWM (MB)", "lower",
                    peak_rss_mb(model, EMBER, "hwm_mb"), peak_rss_mb(model, PEER, "hwm_mb")))
    rows.append(row("load (s), first start", "lower", load_seconds(model, EMBER), load_seconds(model, PEER)))
    rows.append(row("load (s), later starts", "lower", load_seconds(model, EMBER, later=True),
                    load_seconds(model, PEER, later=True)))
    rows.append(row("failed requests", "0", failed_requests(model, EMBER), failed_requests(model, PEER)))
    return rows


# ---------------------------------------------------------------- report

def fmt_value(name: str, value) -> str:
    if name == "failed requests":
        return plot_bench.fmt(value, 0)
    return plot_bench.fmt(value, 2 if name.startswith("c1 TPOT") or name.startswith("load") else 1)


def model_section(model: dict) -> list[str]:
    if model["path"] is None:
        return [f"### {model['label']}", "", f"- FAILED: `{model['failed'][0]['error'][-300:]}`", ""]
    mb = model["bytes_per_token"] / 2**20
    lines = [f"### {model['label']}", "",
             f"`{model['path']}`: {model['architecture']}, {model['file_type']}, {model['file_bytes'] / 2**20:,.0f} MiB; "
             f"{mb:,.0f} MiB of weights read per token"
             + (" (embedding table tied to the LM head)" if model["tied_embeddings"] else ""), ""]
    lines += plot_bench.table(["row", EMBER, PEER, f"{EMBER} / {PEER}", "better"],
                              [[r["row"], fmt_value(r["row"], r[EMBER]), fmt_value(r["row"], r[PEER]),
                                "-" if r["ratio"] is None else f"{r['ratio']:.2f}x", r["better"]]
                               for r in model["rows"]])
    for f in model["failed"]:
        lines += ["", f"- FAILED {f['group']}: `{f['error'][-300:]}`"]
    return lines + [""]


SUMMARY_ROWS = ("c1 TPOT (ms)", "c1 % of bandwidth floor, file bytes", "prefill 512 (tok/s)",
                "c8 output tok/s", "c16 output tok/s", "c8-sampled output tok/s", "peak RSS (MB)")


def summary_section(models: list[dict]) -> list[str]:
    """One line per model: the ember-cupy / llama.cpp ratio of each row (floor: both values)."""
    header = ["model", *SUMMARY_ROWS, "failed (ember / llama)"]
    body = []
    for m in models:
        by_name = {r["row"]: r for r in m["rows"]}
        cells = []
        for name in SUMMARY_ROWS:
            r = by_name.get(name)
            if r is None:
                cells.append("-")
            elif "floor" in name:
                cells.append(f"{plot_bench.fmt(r[EMBER], 0)}% / {plot_bench.fmt(r[PEER], 0)}%")
            else:
                cells.append("-" if r["ratio"] is None else f"{r['ratio']:.2f}x")
        failed = by_name["failed requests"]
        body.append([m["label"], *cells, f"{failed[EMBER]} / {failed[PEER]}"])
    return ["### Ratios, ember-cupy / llama.cpp", "", *plot_bench.table(header, body), "",
            "TPOT and peak RSS: below 1x is better for ember-cupy; tok/s: above 1x. The floor column gives "
            "each engine's c1 TPOT as a % of the time to read the file's weights once at the measured bandwidth.", ""]


def ember_kernels_note(models: list[dict]) -> str:
    """ember-cupy's backend and host-kernel ISA as its /version reported them (first model)."""
    for m in models:
        info = (m.get("single") or {}).get(EMBER, {}).get("server_info")
        if info:
            host = info.get("host_kernels") or {}
            kernels = (f"host kernels {host.get('isa')} x {host.get('threads')} threads" if host.get("active")
                       else "host kernels off")
            return f"ember-cupy {info.get('version')}: backend {info.get('backend')}, {kernels}"
    return "ember-cupy: backend not reported (no single row group)"


def render(results: dict) -> str:
    m, mach = results["meta"], results["meta"]["machine"]
    bw = m["bandwidth"]
    lines = [BEGIN, f"## Model matrix: generated {m['finished']} by tools/bench_models.py", "",
             f"- Machine: {mach['cpu']}, {mach['nproc']} CPUs, {mach['memory']} RAM; ember-cupy {mach['ember_commit']}"
             + (" (uncommitted changes in ember_cupy/)" if mach.get("ember_dirty") else ""),
             f"- Read bandwidth: {bw['gb_per_s']:.1f} GB/s ({bw['method']}, {bw['array_bytes'] / 2**30:.0f} GiB, "
             f"{bw['threads']} threads, best of {bw['repeats']}, at the start and the end of the run)",
             f"- llama-server {m['llama_version']}: {m['amx_note']}",
             f"- {ember_kernels_note(results['models'])}",
             f"- Command: `{m['argv']}` ({m['started']} to {m['finished']}, {m['elapsed_s'] / 60:.0f} min); "
             f"{m['repeats']} repeat(s), --max-seconds {m['max_seconds']:g}",
             "- Synthetic models: random weights at the real shapes with SmolLM2's tokenizer "
             "(tools/make_synthetic_gguf.py): their speed is real, their text is noise.", ""]
    lines += summary_section(results["models"])
    for model in results["models"]:
        lines += model_section(model)
    return "\n".join(lines + [END]) + "\n"


def write_results(results: dict, out_dir: str, markdown: str | None) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "models.json"), "w") as f:
        json.dump(results, f, indent=2)
    if markdown:
        plot_bench.splice(markdown, render(results), BEGIN, END)
    print(f"wrote {out_dir}/models.json" + (f", {markdown}" if markdown else ""))


# ---------------------------------------------------------------- main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True, help="comma list: paths, smollm2, synthetic:<shape>:<type>, "
                                                     f"{ALL_SYNTHETIC}")
    ap.add_argument("--rows", default=",".join(ROW_GROUPS), help=f"comma list of {', '.join(ROW_GROUPS)}")
    ap.add_argument("--synthetic-dir", default=str(synth.CACHE))
    ap.add_argument("--bandwidth-gib", type=float, default=1.0, help="array size of the bandwidth probe")
    bv.add_measurement_arguments(ap)
    ap.set_defaults(repeats=1, max_seconds=120.0, log_dir="/tmp/ember-bench-models-logs")
    ap.add_argument("--markdown", default=str(bv.ROOT / "BENCHMARKS.md"), help="'' for none")
    ap.add_argument("--out-dir", default=str(bv.ROOT / "benchmarks" / "models"))
    args = ap.parse_args(argv)
    args.model_specs, args.row_groups = expand_models(args.models), parse_rows(args.rows)
    return args


def probe_bandwidth(args) -> dict:
    return read_bandwidth(int(args.bandwidth_gib * 2**30), threads=args.threads)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.llama_bin = args.llama_server or llamacpp.ensure_llama_server()
    amx = llamacpp.amx_note(args.llama_bin)
    print(f"models: {', '.join(args.model_specs)}; rows: {', '.join(args.row_groups)}; {amx}", flush=True)
    started, t0 = time.strftime("%Y-%m-%d %H:%M:%S"), time.monotonic()
    bandwidths = [probe_bandwidth(args)]
    print(f"read bandwidth {bandwidths[0]['gb_per_s']:.1f} GB/s", flush=True)
    results = {"meta": {"argv": shlex.join([sys.executable, *sys.argv]), "started": started,
                        "machine": machine(), "llama_server": args.llama_bin,
                        "llama_version": llamacpp.llama_server_version(args.llama_bin), "amx_note": amx,
                        "repeats": args.repeats, "max_seconds": args.max_seconds, "rows": args.row_groups,
                        "ember_args": args.ember_args, "llama_args": args.llama_args},
               "models": []}
    for spec in args.model_specs:
        results["models"].append(run_model(spec, args))
        bv.checkpoint(results, args)
    bandwidths.append(probe_bandwidth(args))
    best = max(bandwidths, key=lambda b: b["bytes_per_s"])
    for model in results["models"]:
        model["rows"] = matrix_rows(model, best["bytes_per_s"])
    results["meta"] |= {"bandwidth": best, "bandwidth_probes_gb_per_s": [b["gb_per_s"] for b in bandwidths],
                        "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "elapsed_s": round(time.monotonic() - t0)}
    write_results(results, args.out_dir, args.markdown or None)
    print("\n".join(summary_section(results["models"])))
    bad = [m["label"] for m in results["models"]
           if m["failed"] or any(r["row"] == "failed requests" and (r[EMBER] or r[PEER]) for r in m["rows"])]
    print(f"models with failures: {', '.join(bad) or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
