"""Milliseconds per step of the sampler alone, on random host logits.

    python tools/bench_sampler.py [--batch 16] [--vocab 49152] [--steps 20] [--scale 3.0]

Logits are N(0, scale^2) per token (scale 3 puts ~95% of the mass in a few hundred tokens, about
where a small chat model's next-token distribution sits); every scenario samples the same logits.
Scenarios: greedy; temperature 0.8 with top_p 0.95 and top_k 40; top_p 0.95 alone; and the
latter's top-k/top-p with repetition, frequency and presence penalties over a 1024-token prompt and
256 generated tokens per sequence.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ember_cupy import SamplingParams
from ember_cupy.engine.sampler import Sampler
from ember_cupy.engine.sequence import Sequence

SCENARIOS = {
    "greedy": dict(temperature=0.0),
    "t0.8 top_p0.95 top_k40": dict(temperature=0.8, top_p=0.95, top_k=40),
    "t0.8 top_p0.95": dict(temperature=0.8, top_p=0.95),
    "t0.8 top_p0.95 top_k40 + penalties": dict(temperature=0.8, top_p=0.95, top_k=40, repetition_penalty=1.1,
                                               frequency_penalty=0.5, presence_penalty=0.3),
}


def _seqs(batch: int, vocab: int, params: SamplingParams, rng: np.random.Generator) -> list[Sequence]:
    seqs = []
    for i in range(batch):
        seq = Sequence(f"s{i}", [int(t) for t in rng.integers(0, vocab, 1024)], params, 4096, index=i)
        seq.token_ids += [int(t) for t in rng.integers(0, vocab // 8, 256)]
        seqs.append(seq)
    return seqs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--scale", type=float, default=3.0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    logits = [(rng.standard_normal((args.batch, args.vocab)) * args.scale).astype(np.float32)
              for _ in range(4)]
    sampler = Sampler(eos_token_ids=(0,))
    print(f"batch {args.batch}, vocab {args.vocab}, logits N(0, {args.scale}^2), median of {args.steps} steps")
    for name, fields in SCENARIOS.items():
        seqs = _seqs(args.batch, args.vocab, SamplingParams(seed=1, **fields), rng)
        for step in range(2):
            sampler(logits[step % len(logits)], seqs)
        times = []
        for step in range(args.steps):
            start = time.perf_counter()
            sampler(logits[step % len(logits)], seqs)
            times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1e3
        print(f"  {name:38s} {ms:8.2f} ms/step  ({ms / args.batch:6.3f} ms/row)")


if __name__ == "__main__":
    main()
