"""Milliseconds per quantized or 16-bit float matmul (cpu/matmul_q.c, cpu/matmul_16bit.c) on each
host-kernel ISA path, side by side.

    python tools/bench_matmul.py                          # every path this CPU runs
    python tools/bench_matmul.py --isa avx512vnni --isa avx512amx --rows 1,16,256
    python tools/bench_matmul.py --shape llama-1b --formats Q4_K,Q6_K,Q5_0,Q4_0,Q8_0 --rows 1,8,16,64
    python tools/bench_matmul.py --shape llama-1b --formats BF16,F16 --rows 1,8,16,64
    python tools/bench_matmul.py --shape llama-1b --formats Q4_K,Q6_K,Q8_0 --rows 1 --from-dram

Random weights in SmolLM2-135M's shapes (Q4_1 qkv / o / gate_up / down, the Q8_0 tied LM head),
or a Llama-3.2-1B layer's matrices in each of --formats (GB/s of weights read beside each time),
activations N(0, 1) times a per-column scale in [0.2, 3] (some columns carry outliers, as real
ones do), the engine's default activation quantization. The paths run alternately, the minimum of
the repeats is reported (run on an idle machine: 2 cores, one busy process ruins a timing).
A matrix timed over and over sits in the caches (a 1B layer's gate_up is 19 MB); --from-dram cycles
through copies of each matrix, ~400 MB of them, so that every call reads its weights from memory,
as a decode step does.
"""
from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import replace

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

from ember_cupy.backend import keep_freed_memory_mapped
from ember_cupy.config import EngineConfig
from ember_cupy.ops import _host
from ember_cupy.ops.linear import matmul_q
from ember_cupy.ops.pack import to_kernel_format
from ember_cupy.quant import HALF_TYPES, ActivationQuantization, QuantizedTensor, half_tensor

SHAPES = {"qkv": (960, 576, "Q4_1"), "o": (576, 576, "Q4_1"), "gate_up": (3072, 576, "Q4_1"),
          "down": (576, 1536, "Q4_1"), "lm_head": (49152, 576, "Q8_0")}
LLAMA_1B = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
# K-quant blocks (gguf cannot quantize them): random bytes, f16 scales of 0.01 at these offsets
_K_QUANTS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def random_weight(rng, rows: int, cols: int, qtype: str):
    if qtype in HALF_TYPES:
        values = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        bits = values.astype(np.float16).view(np.uint16) if qtype == "F16" else (values.view(np.uint32) >> 16)
        return to_kernel_format(half_tensor(bits.astype(np.uint16), qtype))
    if qtype in _K_QUANTS:
        block_bytes, scale_offsets = _K_QUANTS[qtype]
        data = rng.integers(0, 256, (rows, cols // 256, block_bytes), dtype=np.uint8)
        for offset in scale_offsets:
            data[..., offset:offset + 2] = np.array([0.01], np.float16).view(np.uint8)
        return to_kernel_format(QuantizedTensor(qtype, data.reshape(rows, -1), (rows, cols)))
    values = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    return to_kernel_format(QuantizedTensor(qtype, quantize(values, QT[qtype]), (rows, cols)))


def weight_set(rng, shape: str, formats: list[str]) -> dict:
    if shape == "smollm2":
        return {name: random_weight(rng, *spec) for name, spec in SHAPES.items()}
    return {f"{name}:{qtype}": random_weight(rng, rows, cols, qtype)
            for qtype in formats for name, (rows, cols) in LLAMA_1B.items()}


DRAM_BYTES = 400 << 20


def random_like(rng, weight):
    """Another matrix of weight's format and shape (its bytes reshuffled: same speed, new addresses)."""
    data = weight.data.copy()
    rng.shuffle(data.reshape(-1, data.shape[-1]))
    return replace(weight, data=data)


def seconds(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", action="append", help="a path to time (repeatable; default: all this CPU runs)")
    ap.add_argument("--rows", default="1,16,256", help="rows of x (comma-separated)")
    ap.add_argument("--shape", choices=["smollm2", "llama-1b"], default="smollm2")
    ap.add_argument("--formats", default="Q4_K,Q6_K", help="with --shape llama-1b (comma-separated)")
    ap.add_argument("--passes", type=int, default=EngineConfig.activation_passes)
    ap.add_argument("--second-pass-threshold", type=float, default=EngineConfig.second_pass_threshold)
    ap.add_argument("--from-dram", action="store_true", help="cycle through ~400 MB of copies of each matrix")
    args = ap.parse_args(argv)
    keep_freed_memory_mapped()   # as the engine does: a 512-row gate_up's 33 MB output is not fresh pages each call
    isas = args.isa or [isa for isa in _host.supported_isas() if isa != "portable"]
    libraries = [_host.load_library(isa) for isa in isas]
    scheme = ActivationQuantization(args.passes, args.second_pass_threshold)
    rng = np.random.default_rng(0)
    weights = weight_set(rng, args.shape, args.formats.split(","))
    copies = {name: [weight] + ([random_like(rng, weight) for _ in range(DRAM_BYTES // weight.nbytes)]
                                if args.from_dram else []) for name, weight in weights.items()}
    print(f"ms per matmul (GB/s of weights), min of repeats, {libraries[0].threads} thread(s), {scheme}")
    print(f"{'rows':>5} {'matrix':12} " + " ".join(f"{isa:>18}" for isa in isas))
    for m in (int(r) for r in args.rows.split(",")):
        for name, weight in weights.items():
            cycle = itertools.cycle(copies[name])
            cols = weight.shape[1]
            x = (rng.standard_normal((m, cols)) * rng.uniform(0.2, 3, (1, cols))).astype(np.float32)
            repeats = max(3, 2000 // m // (10 if name == "lm_head" or args.shape != "smollm2" else 1))
            best = [float("inf")] * len(libraries)
            for _ in range(repeats):          # alternate the paths: drift hits them alike
                for i, library in enumerate(libraries):
                    best[i] = min(best[i], seconds(lambda: matmul_q(x, next(cycle), library, scheme)))
            print(f"{m:5d} {name:12} " + " ".join(f"{1e3 * b:10.3f} ({weight.nbytes / b / 1e9:4.1f})" for b in best))


if __name__ == "__main__":
    main()
