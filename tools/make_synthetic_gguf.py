"""Random-weight GGUFs at real models' shapes, for benchmarking speed on sizes we have no weights for.

Each file has the architecture metadata llama.cpp and ember-cupy need, SmolLM2's tokenizer (all
`tokenizer.*` keys copied from the SmolLM2 GGUF, so both engines tokenize prompts the same and the
vocabulary is SmolLM2's 49,152 tokens), f16 matrices drawn from N(0, std) (default 0.02; norm
weights 1.0, biases N(0, std)) so activations stay finite through all layers. The f16 file is then
quantized by llama.cpp's llama-quantize (tools/llamacpp.py builds it) into each requested type.
Files go to ~/.cache/ember-cupy/synthetic/ (or --out-dir, $EMBER_BENCH_CACHE/synthetic); a file
that is already there is kept. The text these models generate is noise: only their speed means
anything. Not modelled: llama 3.2's rope scaling (the `rope_freqs` tensor), which costs nothing.

    python tools/make_synthetic_gguf.py --shape llama-3.2-1b --types Q4_K_M,Q8_0
    python tools/make_synthetic_gguf.py --shape all --types Q4_K_M,Q5_K_M,Q6_K,Q8_0,Q4_0
    python tools/make_synthetic_gguf.py --shape tiny --types Q8_0     # seconds; for smoke runs
    python tools/make_synthetic_gguf.py --list                        # the shapes

In code: `ensure_synthetic("llama-3.2-1b", "Q4_K_M")` returns the path (written if missing);
`parse_spec("synthetic:qwen2.5-0.5b:Q8_0")` -> ("qwen2.5-0.5b", "Q8_0").
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp

CACHE = llamacpp.CACHE.parent / "synthetic"
SPEC_PREFIX = "synthetic:"
DEFAULT_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0")
F16 = "F16"               # a type name that means the unquantized f16 source file itself
RMS_EPS = 1e-5


@dataclass(frozen=True)
class SyntheticShape:
    """The dimensions of one model; heads * head_dim need not equal hidden."""
    arch: str             # GGUF general.architecture: "llama" or "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float
    context: int
    qkv_bias: bool = False
    tied: bool = True     # no output.weight: the LM head reads token_embd


SHAPES = {
    "llama-3.2-1b": SyntheticShape("llama", 2048, 16, 32, 8, 64, 8192, 500000.0, 131072),
    "llama-3.2-3b": SyntheticShape("llama", 3072, 28, 24, 8, 128, 8192, 500000.0, 131072),
    "qwen2.5-0.5b": SyntheticShape("qwen2", 896, 24, 14, 2, 64, 4864, 1000000.0, 32768, qkv_bias=True),
    "tiny": SyntheticShape("llama", 64, 2, 4, 2, 16, 128, 10000.0, 2048),   # tests and smoke runs
}


def parse_spec(spec: str) -> tuple[str, str]:
    """`synthetic:<shape>:<type>` -> (shape, TYPE); raises ValueError naming what is known."""
    if not spec.startswith(SPEC_PREFIX):
        raise ValueError(f"{spec!r} does not start with {SPEC_PREFIX!r}")
    parts = spec[len(SPEC_PREFIX):].split(":")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"{spec!r}: expected synthetic:<shape>:<type>, e.g. synthetic:llama-3.2-1b:Q4_K_M")
    shape, qtype = parts[0], parts[1].upper()
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return shape, qtype


def synthetic_path(shape: str, qtype: str, out_dir: Path = CACHE) -> Path:
    return Path(out_dir) / f"synthetic-{shape}.{qtype.upper()}.gguf"


def tensor_plan(s: SyntheticShape, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF tensor name, numpy shape [rows, cols], kind: matrix / norm / bias), in file order."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    plan = [("token_embd.weight", (vocab, s.hidden), "matrix"), ("output_norm.weight", (s.hidden,), "norm")]
    if not s.tied:
        plan.append(("output.weight", (vocab, s.hidden), "matrix"))
    for i in range(s.layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (s.hidden,), "norm"),
                 (b + "attn_q.weight", (q, s.hidden), "matrix"),
                 (b + "attn_k.weight", (kv, s.hidden), "matrix"),
                 (b + "attn_v.weight", (kv, s.hidden), "matrix")]
        if s.qkv_bias:
            plan += [(b + "attn_q.bias", (q,), "bias"), (b + "attn_k.bias", (kv,), "bias"),
                     (b + "attn_v.bias", (kv,), "bias")]
        plan += [(b + "attn_output.weight", (s.hidden, q), "matrix"),
                 (b + "ffn_norm.weight", (s.hidden,), "norm"),
                 (b + "ffn_gate.weight", (s.ffn, s.hidden), "matrix"),
                 (b + "ffn_up.weight", (s.ffn, s.hidden), "matrix"),
                 (b + "ffn_down.weight", (s.hidden, s.ffn), "matrix")]
    return plan


def parameter_count(s: SyntheticShape, vocab: int) -> int:
    return sum(int(np.prod(shape)) for _, shape, _ in tensor_plan(s, vocab))


def tensor_dtype(kind: str):
    """Matrices f16 (llama-quantize's input), norms and biases f32 (as llama.cpp's converter)."""
    return np.float16 if kind == "matrix" else np.float32


def random_tensor(rng: np.random.Generator, shape, kind: str, std: float) -> np.ndarray:
    if kind == "norm":
        return np.ones(shape, np.float32)
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= np.float32(std)
    return values.astype(tensor_dtype(kind))


def add_architecture(writer, name: str, s: SyntheticShape, vocab: int) -> None:
    """The `<arch>.*` hyperparameters llama.cpp's loader reads, and the general.* keys."""
    import gguf
    writer.add_name(f"synthetic {name} (random weights)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_vocab_size(vocab)


def copy_tokenizer(writer, reader) -> None:
    """Copy every `tokenizer.*` key of the GGUFReader `reader` into `writer`."""
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            llamacpp._copy_field(writer, name, field)


def vocab_size(reader) -> int:
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def fast_reader(path: str):
    """A gguf.GGUFReader of `path` (its fields are what GGUFWriter copies)."""
    import gguf
    return gguf.GGUFReader(path)


def default_tokenizer_gguf() -> str:
    from ember_cupy.model.loader import default_model_path
    return str(default_model_path())


def write_f16_gguf(shape_name: str, path: str, s: SyntheticShape | None = None, *, std: float = 0.02,
                   seed: int = 0, tokenizer_gguf: str | None = None) -> str:
    """Write the random f16 GGUF of SHAPES[shape_name] (or `s`) to `path`, tensor by tensor
    (memory: one tensor at a time); via path.tmp, renamed when complete."""
    import gguf
    s = s or SHAPES[shape_name]
    tmp = str(path) + ".tmp"
    tokenizer = fast_reader(tokenizer_gguf or default_tokenizer_gguf())
    vocab = vocab_size(tokenizer)
    writer = gguf.GGUFWriter(tmp, s.arch)
    add_architecture(writer, shape_name, s, vocab)
    copy_tokenizer(writer, tokenizer)
    plan = tensor_plan(s, vocab)
    for name, shape, kind in plan:
        itemsize = np.dtype(tensor_dtype(kind)).itemsize
        writer.add_tensor_info(name, shape, np.dtype(tensor_dtype(kind)), int(np.prod(shape)) * itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, kind in plan:
        writer.write_tensor_data(random_tensor(rng, shape, kind, std))
    writer.close()
    os.replace(tmp, path)
    return str(path)


def ensure_synthetic(shape: str, qtype: str, out_dir: Path = CACHE, *, std: float = 0.02,
                     seed: int = 0, timings: dict | None = None) -> str:
    """The path of synthetic-<shape>.<qtype>.gguf in out_dir, written (f16 source, then
    llama-quantize) if missing; seconds spent go to timings[(shape, type)] when given."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    f16 = synthetic_path(shape, F16, out_dir)
    if not f16.exists():
        t0 = time.monotonic()
        write_f16_gguf(shape, str(f16), std=std, seed=seed)
        _record(timings, shape, F16, time.monotonic() - t0)
    target = synthetic_path(shape, qtype, out_dir)
    if not target.exists():
        t0 = time.monotonic()
        llamacpp.quantize_gguf(str(f16), str(target), qtype.upper(), log=str(target) + ".log")
        _record(timings, shape, qtype.upper(), time.monotonic() - t0)
    return str(target)


def _record(timings, shape, qtype, seconds):
    print(f"wrote synthetic {shape} {qtype} in {seconds:.1f} s", flush=True)
    if timings is not None:
        timings[(shape, qtype)] = round(seconds, 1)


def shape_names(text: str) -> list[str]:
    names = list(SHAPES) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
    if text == "all":
        names.remove("tiny")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="all", help=f"comma list of {', '.join(SHAPES)}, or all (not tiny)")
    ap.add_argument("--types", default=",".join(DEFAULT_TYPES), help="llama-quantize types; F16: the source only")
    ap.add_argument("--out-dir", default=str(CACHE))
    ap.add_argument("--std", type=float, default=0.02, help="std of the random matrices and biases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="print the shapes and their parameter counts")
    args = ap.parse_args(argv)
    if args.list:
        for name, s in SHAPES.items():
            print(f"{name}: {parameter_count(s, 49152) / 1e6:,.0f}M parameters, {s}")
        return 0
    timings = {}
    for shape in shape_names(args.shape):
        for qtype in [t.strip().upper() for t in args.types.split(",") if t.strip()]:
            print(ensure_synthetic(shape, qtype, Path(args.out_dir), std=args.std, seed=args.seed,
                                   timings=timings), flush=True)
    for (shape, qtype), seconds in timings.items():
        print(f"{shape} {qtype}: {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
