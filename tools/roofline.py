"""Roofline estimate of one decode step on a GPU, kernel family by kernel family.

For each family: the bytes it must move through HBM, the FLOPs it must do, and the time that
the slower of the two takes at the device's peak (`max(bytes / bandwidth, flops / peak)`), with
the peak of the pipe the kernel uses: tensor cores for 16-bit GEMMs from 16 rows up (and for the
quantized GEMMs that dequantize into mma fragments), CUDA cores for GEMVs and attention decode.
The step's floor is the sum; `launch_us` adds what ~2.5 us per launch costs without CUDA graphs.

This is what the first device run (tools/gpu_check.py, benchmarks/gpu/) is read against:
`python tools/roofline.py --markdown BENCHMARKS.md` rewrites the section between its markers.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    intermediate: int
    vocab: int


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    bandwidth: float        # bytes/s, HBM
    tensor_flops: float     # dense f16/bf16 mma, FLOP/s
    cuda_core_flops: float  # fp32 FMA, FLOP/s
    launch_s: float         # per kernel launch from Python, without graphs


SHAPES = {
    "smollm2-135m": Shape("SmolLM2-135M", 576, 9, 3, 64, 30, 1536, 49152),
    "llama3-8b": Shape("Llama-3-8B", 4096, 32, 8, 128, 32, 14336, 128256),
}
H200 = Device("H200", 4.8e12, 989e12, 67e12, 2.5e-6)
# bytes per weight as served on the device (GGUF blocks of 32: Q8_0 34 B, Q4_1 20 B, Q4_0 18 B)
WEIGHT_BYTES = {"bf16": 2.0, "q8_0": 34 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32}
ACTIVATION_BYTES = 2      # bf16 activations
KV_BYTES = 2              # f16 / bf16 KV cache
LOGIT_BYTES = 4           # float32 logits
TENSOR_CORE_MIN_ROWS = 16  # below this a GEMM runs as a GEMV on CUDA cores
LAUNCHES_PER_LAYER = 10   # norm, qkv, rope, kv write, attention (+ merge), o, add+norm, gate_up, act, down
SAMPLING_PASSES = 3       # reads of the logits row: penalties/temperature, threshold search, draw


@dataclasses.dataclass
class Estimate:
    family: str
    bytes: float
    flops: float
    seconds: float
    bound: str


def _kernel(family: str, nbytes: float, flops: float, peak: float, device: Device) -> Estimate:
    memory, compute = nbytes / device.bandwidth, flops / peak
    return Estimate(family, nbytes, flops, max(memory, compute), "memory" if memory >= compute else "compute")


def decode_step(shape: Shape, fmt: str, batch: int, context: int, device: Device = H200) -> list[Estimate]:
    """The kernel families of one decode step of `batch` sequences at `context` tokens each."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    matrices = {"qkv": (shape.hidden, q + 2 * kv), "o": (q, shape.hidden),
                "gate_up": (shape.hidden, 2 * shape.intermediate), "down": (shape.intermediate, shape.hidden)}
    gemm_peak = device.tensor_flops if batch >= TENSOR_CORE_MIN_ROWS else device.cuda_core_flops
    out = []
    for name, (k, n) in matrices.items():
        weights = k * n * WEIGHT_BYTES[fmt] * shape.layers
        io = batch * (k + n) * ACTIVATION_BYTES * shape.layers
        out.append(_kernel(f"linear {name}", weights + io, 2 * batch * k * n * shape.layers, gemm_peak, device))
    kv_read = batch * context * 2 * kv * KV_BYTES * shape.layers
    out.append(_kernel("attention decode", kv_read + 2 * batch * q * ACTIVATION_BYTES * shape.layers,
                       4 * batch * context * q * shape.layers, device.cuda_core_flops, device))
    elementwise = batch * shape.layers * ACTIVATION_BYTES * (8 * shape.hidden + 2 * q + 4 * kv + 3 * shape.intermediate)
    out.append(_kernel("norms, rope, kv write, act", elementwise, 0.0, device.cuda_core_flops, device))
    head = shape.vocab * shape.hidden * WEIGHT_BYTES[fmt] + batch * shape.vocab * LOGIT_BYTES
    out.append(_kernel("lm head", head, 2 * batch * shape.vocab * shape.hidden, gemm_peak, device))
    out.append(_kernel("sampling", SAMPLING_PASSES * batch * shape.vocab * LOGIT_BYTES, 0.0,
                       device.cuda_core_flops, device))
    return out


def launches(shape: Shape) -> int:
    return LAUNCHES_PER_LAYER * shape.layers + 4   # + embedding, final norm, lm head, sampling


def table(shape_names=("smollm2-135m", "llama3-8b"), formats=("bf16", "q4_1"), batches=(1, 16, 64),
          contexts=(512, 1024), device: Device = H200) -> list[dict]:
    rows = []
    for name in shape_names:
        shape = SHAPES[name]
        for fmt in formats:
            for context in contexts:
                for batch in batches:
                    parts = decode_step(shape, fmt, batch, context, device)
                    floor = sum(p.seconds for p in parts)
                    rows.append({"model": shape.name, "format": fmt, "context": context, "batch": batch,
                                 "parts": parts, "floor_us": floor * 1e6,
                                 "launch_us": launches(shape) * device.launch_s * 1e6,
                                 "bytes": sum(p.bytes for p in parts)})
    return rows


BEGIN, END = "<!-- roofline:begin -->", "<!-- roofline:end -->"


def markdown(rows: list[dict], device: Device = H200) -> str:
    lines = [BEGIN, f"## GPU roofline: one decode step on an {device.name} (estimate, `tools/roofline.py`)", "",
             f"Peaks assumed: {device.bandwidth / 1e12:.1f} TB/s HBM, {device.tensor_flops / 1e12:.0f} TFLOP/s dense "
             f"bf16 tensor cores (GEMMs of >= {TENSOR_CORE_MIN_ROWS} rows), {device.cuda_core_flops / 1e12:.0f} TFLOP/s "
             f"fp32 CUDA cores (GEMVs, attention decode); bf16 activations, f16 KV, fp32 logits. A kernel's "
             "floor is max(bytes / bandwidth, FLOPs / peak); the step's floor is their sum. Launch overhead is "
             f"{launches(SHAPES['smollm2-135m'])} / {launches(SHAPES['llama3-8b'])} launches x "
             f"{device.launch_s * 1e6:.1f} us without CUDA graphs.", "",
             "| model | weights | context | batch | step floor (us) | launches (us) | MB moved | "
             "largest parts (us, bound) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        top = sorted(r["parts"], key=lambda p: -p.seconds)[:3]
        parts = "; ".join(f"{p.family} {p.seconds * 1e6:.1f} ({p.bound[0]})" for p in top)
        lines.append(f"| {r['model']} | {r['format']} | {r['context']} | {r['batch']} | {r['floor_us']:.1f} | "
                     f"{r['launch_us']:.0f} | {r['bytes'] / 1e6:.1f} | {parts} |")
    for model, fmt, context, batch in DETAIL:
        r = next((r for r in rows if (r["model"], r["format"], r["context"], r["batch"]) == (model, fmt, context, batch)),
                 None)
        if r is None:
            continue
        lines += ["", f"Per kernel family, {model} {fmt}, batch {batch}, context {context} (all layers):", "",
                  "| kernel family | MB | GFLOP | floor (us) | bound |", "|---|---|---|---|---|"]
        lines += [f"| {p.family} | {p.bytes / 1e6:.2f} | {p.flops / 1e9:.2f} | {p.seconds * 1e6:.1f} | {p.bound} |"
                  for p in r["parts"]]
    return "\n".join(lines + ["", END])


DETAIL = [("SmolLM2-135M", "q4_1", 512, 16), ("Llama-3-8B", "q4_1", 1024, 16)]


def write_section(path: Path, section: str) -> None:
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", help="rewrite the roofline section of this file (e.g. BENCHMARKS.md)")
    args = ap.parse_args(argv)
    section = markdown(table())
    if args.markdown:
        write_section(Path(args.markdown), section)
    else:
        print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
