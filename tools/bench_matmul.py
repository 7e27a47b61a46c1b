"""Milliseconds per quantized matmul (cpu/matmul_q.c) on each host-kernel ISA path, side by side.

    python tools/bench_matmul.py                          # every path this CPU runs
    python tools/bench_matmul.py --isa avx512vnni --isa avx512amx --rows 1,16,256

Random weights in SmolLM2-135M's shapes (Q4_1 qkv / o / gate_up / down, the Q8_0 tied LM head),
activations N(0, 1) times a per-column scale in [0.2, 3] (some columns carry outliers, as real
ones do), the engine's default activation quantization. The paths run alternately, the minimum of
the repeats is reported (run on an idle machine: 2 cores, one busy process ruins a timing).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

from ember_cupy.config import EngineConfig
from ember_cupy.ops import _host
from ember_cupy.ops.linear import matmul_q
from ember_cupy.packed_weight import to_kernel_format
from ember_cupy.quant import ActivationQuantization, QuantizedTensor

SHAPES = {"qkv": (960, 576, "Q4_1"), "o": (576, 576, "Q4_1"), "gate_up": (3072, 576, "Q4_1"),
          "down": (576, 1536, "Q4_1"), "lm_head": (49152, 576, "Q8_0")}


def random_weight(rng, rows: int, cols: int, qtype: str):
    values = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    return to_kernel_format(QuantizedTensor(qtype, quantize(values, QT[qtype]), (rows, cols)))


def seconds(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", action="append", help="a path to time (repeatable; default: all this CPU runs)")
    ap.add_argument("--rows", default="1,16,256", help="rows of x (comma-separated)")
    ap.add_argument("--passes", type=int, default=EngineConfig.activation_passes)
    ap.add_argument("--second-pass-threshold", type=float, default=EngineConfig.second_pass_threshold)
    args = ap.parse_args(argv)
    isas = args.isa or [isa for isa in _host.supported_isas() if isa != "portable"]
    libraries = [_host.load_library(isa) for isa in isas]
    scheme = ActivationQuantization(args.passes, args.second_pass_threshold)
    rng = np.random.default_rng(0)
    weights = {name: random_weight(rng, *shape) for name, shape in SHAPES.items()}
    print(f"ms per matmul, min of repeats, {libraries[0].threads} thread(s), {scheme}")
    print(f"{'rows':>5} {'matrix':8} " + " ".join(f"{isa:>11}" for isa in isas))
    for m in (int(r) for r in args.rows.split(",")):
        for name, weight in weights.items():
            cols = weight.shape[1]
            x = (rng.standard_normal((m, cols)) * rng.uniform(0.2, 3, (1, cols))).astype(np.float32)
            repeats = max(3, 2000 // m // (10 if name == "lm_head" else 1))
            best = [float("inf")] * len(libraries)
            for _ in range(repeats):          # alternate the paths: drift hits them alike
                for i, library in enumerate(libraries):
                    best[i] = min(best[i], seconds(lambda: matmul_q(x, weight, library, scheme)))
            print(f"{m:5d} {name:8} " + " ".join(f"{1e3 * b:11.3f}" for b in best))


if __name__ == "__main__":
    main()
