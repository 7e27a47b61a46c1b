"""The prepared device check (issue 15): one call on a lent GPU machine, results under $OUT.

Here, once (writes the ignored .gpu_check/ payload, see tools/gpu_payload.py):
    python tools/gpu_check.py prepare
On the device, with `carry: [".gpu_check"]` and a timeout of ~420 s (budget ~5 minutes):
    PYTHONUNBUFFERED=1 python3 tools/gpu_check.py run
Here, the same steps on the stand-in cupy (NumPy + the CPU shim; a CI test runs it):
    python tools/gpu_check.py run --dry-run

Steps, each timed, results rewritten to $OUT/gpu_check.json after each (partial results survive a
timeout), log in $OUT/gpu_check.log:
  1. facts: device, driver/runtime, CuPy, NVRTC, the header folder and NVRTC builtins used;
  2. kernels: every kernel against its NumPy twin in float32/float16/bfloat16, outputs poisoned;
  3. e2e: the cut model's greedy tokens on CuPy float32 must equal the NumPy backend's
     (tests/fixtures/gpu_check_reference.json); float16/bfloat16 logits at the reference's top-64
     tokens within LOGIT_TOLERANCE; agreement of their tokens is reported;
     then again with quantization auto (the GGUF blocks on the device, cuda/matmul_q.cu);
  4. decode: step time at batch 1/16/64, context 512, dtype auto (bf16 for GGUF), CUDA events,
     against the floor of reading weights + KV once at the measured copy bandwidth; dequantized
     (quantization none) and in the GGUF blocks (auto). Read against BENCHMARKS.md's roofline.
Exit status 1 when any step fails. The device leg needs only the image's Python and CuPy plus the
payload: no compiler, no pytest, no network.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

import gpu_payload  # noqa: E402

# max |logit - reference| at the reference's top-64 tokens of each prompt's first position. The
# float32 bound allows for summation order (cuBLAS vs OpenBLAS); the 16-bit ones are ~3-4x what the
# stand-in dry run measured with NumPy's 16-bit GEMMs on the 12-layer cut used until 2026-12-07
# (float16 0.026, bfloat16 0.24, prompt 0; 10 layers since): cuBLAS accumulates in fp32 (ModelRunner
# sets it) so the device should do better.
LOGIT_TOLERANCE = {"float32": 2e-3, "float16": 0.1, "bfloat16": 0.75}
DECODE_BATCHES, DECODE_CONTEXT, DECODE_ITERATIONS = (1, 16, 64), 512, 20


class Report:
    """Collects step results; rewrites the JSON and appends to the log as it goes."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.json_path, self.log_path = out / "gpu_check.json", out / "gpu_check.log"
        self.log_path.write_text("")
        self.steps: list[dict] = []

    def log(self, message: str) -> None:
        print(message, flush=True)
        with open(self.log_path, "a") as f:
            f.write(message + "\n")

    def run(self, name: str, step, *args) -> dict:
        start = time.perf_counter()
        self.log(f"== {name}")
        try:
            result = step(self, *args)
        except Exception as error:  # noqa: BLE001 -- a failed step is reported, the next one runs
            self.log(traceback.format_exc())
            result = {"passed": False, "error": f"{type(error).__name__}: {error}"}
        result["seconds"] = round(time.perf_counter() - start, 2)
        self.log(f"{'PASS' if result.get('passed') else 'FAIL'}  {name} ({result['seconds']} s)")
        self.steps.append({"step": name, **result})
        self.json_path.write_text(json.dumps(self.steps, indent=1, default=str) + "\n")
        return result


# --- start-up on the device: libraries, headers, carried packages ---------------------------
def _reexec_with_nvrtc_builtins() -> None:
    """Put the NVIDIA wheels' lib folders on LD_LIBRARY_PATH and restart Python, once: NVRTC's
    dlopen of libnvrtc-builtins reads LD_LIBRARY_PATH at process start only (ember_cupy also
    preloads the library, ember_cupy.backend.preload_nvrtc_builtins; this covers both)."""
    from ember_cupy.backend import nvidia_wheel_dirs
    folders = [str(p) for p in nvidia_wheel_dirs("lib") if any(p.glob("libnvrtc-builtins.so.*"))]
    current = os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
    missing = [f for f in folders if f not in current]
    if missing and not os.environ.get("EMBER_GPU_CHECK_REEXEC"):
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(missing + [c for c in current if c])
        os.environ["EMBER_GPU_CHECK_REEXEC"] = "1"
        os.execv(sys.executable, [sys.executable, *sys.argv])


def _carried_packages(payload: Path) -> list[str]:
    """Unpack the carried gguf / llguidance when the image cannot import them."""
    import importlib.util
    missing = [n for n in gpu_payload.SITE_PACKAGES if importlib.util.find_spec(n) is None]
    if missing:
        gpu_payload.unpack_site(payload, Path(os.environ.get("TMPDIR", "/tmp")) / "ember_gpu_check_site")
    return missing


def _headers(payload: Path) -> str:
    """The image's CUDA headers if NVRTC can find some, else the carried copies."""
    from ember_cupy.ops import _cuda
    try:
        return str(_cuda.cuda_include_dir())
    except FileNotFoundError:
        os.environ["EMBER_CUDA_INCLUDE"] = str(payload / "include")
        return str(_cuda.cuda_include_dir()) + " (carried)"


# --- steps -----------------------------------------------------------------------------------
def facts(report: Report, cupy, context: dict) -> dict:
    from cupy_backends.cuda.libs import nvrtc

    from ember_cupy.engine.model_runner import resolve_dtype
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    result = {
        "device": name, "compute_capability": cupy.cuda.Device().compute_capability,
        "memory_gib": round(props["totalGlobalMem"] / 2**30, 1), "sms": props["multiProcessorCount"],
        "driver": cupy.cuda.runtime.driverGetVersion(), "runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cupy": cupy.__version__, "nvrtc": nvrtc.getVersion(), "python": platform.python_version(),
        "numpy": __import__("numpy").__version__, "dtype_auto_gguf": str(resolve_dtype("auto", cupy, None)),
        **context, "passed": True}
    report.log(json.dumps(result, default=str))
    return result


def kernels(report: Report, cupy, dtypes) -> dict:
    import gpu_check_kernels
    results = gpu_check_kernels.check_all(cupy, cupy.asnumpy, dtypes)
    for r in results:
        report.log(f"  {'ok  ' if r['passed'] else 'FAIL'} {r['dtype']:9s} {r['kernel']:40s} "
                   f"err {r.get('max_rel_error', float('nan')):.2e} tol {r.get('tolerance', 0):.0e} {r.get('error', '')}")
    return {"cases": results, "passed": all(r["passed"] for r in results)}


def e2e(report: Report, model: Path, reference: dict, dtype: str, prompts: int, max_tokens: int,
        quantization: str = "none") -> dict:
    """quantization="auto": the GGUF blocks stay quantized on the device (cuda/matmul_q.cu); the
    weights' values are the reference's, so float32 must still give its tokens."""
    import numpy as np

    from ember_cupy.quant import DeviceQuantizedWeight
    chosen = gpu_payload.PROMPTS[:prompts]
    tokens, first, engine = gpu_payload.generate(str(model), dtype, chosen, max_tokens, quantization)
    want = {rid: t[:max_tokens] for rid, t in reference["tokens"].items() if int(rid) < prompts}
    same = sum(a == b for rid in want for a, b in zip(tokens[rid], want[rid]))
    total = sum(len(t) for t in want.values())
    errors = []
    for rid, top in reference["first_logits_top"].items():
        if rid in first:
            errors.append(float(np.max(np.abs(first[rid][top["ids"]] - np.asarray(top["values"])))))
    logit_error = max(errors)
    leftover = sorted(engine.checkpoint.weights)     # the model consumes every host tensor it uploads
    quantized = isinstance(engine.runner.model.layers[0].qkv, DeviceQuantizedWeight)
    passed = (logit_error <= LOGIT_TOLERANCE[dtype] and (same == total or dtype != "float32") and not leftover
              and quantized == (quantization != "none"))
    report.log(f"  e2e {dtype}, quantization {quantization}: {same}/{total} greedy tokens equal to NumPy's; "
               f"max logit error {logit_error:.4f} (tolerance {LOGIT_TOLERANCE[dtype]}); served as "
               f"{engine.runner.model.dtype}, {engine.runner.model.weight_bytes() / 1e6:.1f} MB of weights, "
               f"quantized blocks {quantized}; host tensors left {leftover}")
    return {"dtype": dtype, "quantization": quantization, "tokens": tokens, "equal_tokens": same, "total_tokens": total,
            "max_logit_error": logit_error, "tolerance": LOGIT_TOLERANCE[dtype],
            "served_dtype": str(engine.runner.model.dtype), "host_matrices_left": leftover, "passed": passed}


def decode(report: Report, cupy, model: Path, batches, context: int, iterations: int, copy_bytes: int,
           quantization: str = "none") -> dict:
    import numpy as np

    from ember_cupy.config import EngineConfig
    from ember_cupy.engine.model_runner import ModelRunner
    from ember_cupy.model.decoder import BatchMetadata
    from ember_cupy.model.loader import load_checkpoint
    checkpoint = load_checkpoint(str(model))
    cfg, block = checkpoint.config, 16
    blocks_per_seq = context // block
    runner = ModelRunner(checkpoint, EngineConfig(num_kv_blocks=max(batches) * blocks_per_seq + 1,
                                                  quantization=quantization), xp=cupy, consume_checkpoint=True)
    weights = runner.model.weight_bytes()
    bandwidth = _copy_bandwidth(cupy, copy_bytes)
    itemsize = runner.kv_caches[0][0].itemsize
    rows = []
    for batch in batches:
        tables = np.arange(batch * blocks_per_seq, dtype=np.int32).reshape(batch, blocks_per_seq)
        meta = BatchMetadata(
            positions=cupy.asarray(np.full(batch, context - 1, np.int32)),
            slot_mapping=cupy.asarray((tables[:, -1] * block + block - 1).astype(np.int32)),
            block_tables=cupy.asarray(tables), context_lens=cupy.asarray(np.full(batch, context, np.int32)),
            query_start_loc=cupy.asarray(np.arange(batch + 1, dtype=np.int32)),
            logits_indices=cupy.asarray(np.arange(batch, dtype=np.int64)))
        ids = cupy.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, batch))
        ms = _timed(cupy, lambda: runner.model.forward(ids, meta, runner.kv_caches), iterations)
        kv = batch * context * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
        floor = (weights + kv) / bandwidth * 1e3
        rows.append({"batch": batch, "ms_per_step": ms, "floor_ms": floor, "x_floor": ms / floor,
                     "tokens_per_s": batch / ms * 1e3})
        report.log(f"  decode batch {batch:3d}: {ms:8.3f} ms/step  floor {floor:7.4f} ms  ({ms / floor:6.1f}x floor)"
                   f"  {batch / ms * 1e3:9.0f} tok/s")
    report.log(f"  copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights {weights / 1e6:.1f} MB "
               f"({runner.model.dtype}, {cfg.num_layers} layers); context {context}")
    return {"dtype": str(runner.model.dtype), "quantization": quantization, "layers": cfg.num_layers,
            "weights_bytes": weights,
            "copy_bandwidth_bytes_per_s": bandwidth, "context": context, "rows": rows, "passed": True}


def _copy_bandwidth(cupy, nbytes: int) -> float:
    """Device-to-device copy, bytes read + written per second (5 copies after one warm-up)."""
    import numpy as np
    source = cupy.zeros(nbytes, np.uint8)
    target = cupy.empty_like(source)
    target[...] = source
    ms = _timed(cupy, lambda: target.__setitem__(Ellipsis, source), 5)
    return 2 * nbytes / (ms / 1e3)


def _timed(cupy, work, iterations: int) -> float:
    """Mean milliseconds of `work` between CUDA events, after 2 warm-ups."""
    for _ in range(2):
        work()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(iterations):
        work()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / iterations


# --- the run -----------------------------------------------------------------------------------
def run(args) -> int:
    payload = Path(args.payload)
    os.environ["EMBER_HOST_KERNELS"] = "0"     # NumPy twins as written, not the host C kernels
    if not args.dry_run:
        _reexec_with_nvrtc_builtins()
    context = {"carried_packages": _carried_packages(payload), "headers": _headers(payload)}
    report = Report(Path(args.out or os.environ.get("OUT") or "/tmp/gpu_check"))
    reference = json.loads(gpu_payload.REFERENCE.read_text())
    model = payload / "model.gguf"
    if gpu_payload.sha256(model) != reference["model"]["sha256"]:
        report.log(f"FAIL  {model} is not the model the reference was computed on (run prepare, then reference)")
        return 1
    if args.dry_run:
        from tests.kernels.shim import standin_cupy
        with standin_cupy.installed() as cupy:
            return _steps(report, cupy, model, reference, context, dry_run=True)
    import cupy
    os.environ["EMBER_BACKEND"] = "cupy"
    from ember_cupy.backend import preload_nvrtc_builtins
    context["nvrtc_builtins_preloaded"] = preload_nvrtc_builtins()
    return _steps(report, cupy, model, reference, context, dry_run=False)


def _steps(report: Report, cupy, model: Path, reference: dict, context: dict, dry_run: bool) -> int:
    report.run("facts", facts, cupy, context)
    report.run("kernels vs NumPy twins (poisoned outputs)", kernels, cupy,
               ("float32",) if dry_run else ("float32", "float16", "bfloat16"))
    prompts, tokens = (2, 3) if dry_run else (len(gpu_payload.PROMPTS), gpu_payload.MAX_TOKENS)
    for quantization, dtypes in (("none", ("float32", "float16", "bfloat16")), ("auto", ("float32", "bfloat16"))):
        for dtype in dtypes:
            full = dtype == "float32"
            report.run(f"e2e greedy, cupy {dtype}, quantization {quantization} vs NumPy", e2e, model, reference,
                       dtype, prompts if full else 1, tokens if full else 1, quantization)
    batches, context_len, iterations, copy = ((1,), 32, 1, 1 << 20) if dry_run else \
        (DECODE_BATCHES, DECODE_CONTEXT, DECODE_ITERATIONS, 1 << 30)
    for quantization in ("none", "auto"):
        report.run(f"decode step times (CUDA events) vs bandwidth floor, quantization {quantization}", decode,
                   cupy, model, batches, context_len, iterations, copy, quantization)
    report.log("==== summary")
    for step in report.steps:
        report.log(f"{'PASS' if step.get('passed') else 'FAIL'}  {step['step']} ({step['seconds']} s)"
                   f"{'  ' + step['error'] if 'error' in step else ''}")
    return 0 if all(s.get("passed") for s in report.steps) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prepare = sub.add_parser("prepare", help="write the payload the device call carries")
    prepare.add_argument("--payload", default=str(gpu_payload.PAYLOAD))
    reference = sub.add_parser("reference", help="recompute the NumPy reference fixture")
    reference.add_argument("--payload", default=str(gpu_payload.PAYLOAD))
    check = sub.add_parser("run", help="run the check (on the device, or --dry-run here)")
    check.add_argument("--payload", default=str(gpu_payload.PAYLOAD))
    check.add_argument("--out", default=None, help="results folder (default $OUT)")
    check.add_argument("--dry-run", action="store_true", help="the stand-in cupy on this CPU")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        print(json.dumps(gpu_payload.prepare(Path(args.payload))))
        return 0
    if args.command == "reference":
        data = gpu_payload.reference(Path(args.payload))
        print(json.dumps(data["tokens"]))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
