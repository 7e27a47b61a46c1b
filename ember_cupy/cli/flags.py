"""The command line's parsers: the commands, the engine's flags and the EngineConfig they make
(serve's own groups: serve_flags.py)."""
from __future__ import annotations

import argparse

from ember_cupy.cli.flag_values import add_flag, parse_size
from ember_cupy.cli.serve_flags import server_flags
from ember_cupy.config import CPU_MAX_NUM_PREFILL_TOKENS, CPU_MAX_NUM_PREFILL_TOKENS_BF16, DTYPES, KV_CACHE_DTYPES, POLICIES, QUANTIZATIONS, EngineConfig
from ember_cupy.version import __version__


def engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine")
    add_flag(g, "--model", default=None, help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct)")
    add_flag(g, "--max-num-seqs", type=int, default=64, help="sequences per step")
    add_flag(g, "--max-num-batched-tokens", type=int, default=1024, help="tokens per step")
    add_flag(g, "--max-num-prefill-tokens", type=int, default=None,
             help=f"prompt tokens per step, which bound a step's time and so the wait of a request that "
                  f"arrives during a long prefill (default: {CPU_MAX_NUM_PREFILL_TOKENS} on the CPU, "
                  f"{CPU_MAX_NUM_PREFILL_TOKENS_BF16} where prompt rows run on AMX-BF16 tiles, "
                  f"--max-num-batched-tokens on CUDA)")
    add_flag(g, "--max-model-len", type=int, default=None, help="context length (default: the model's, capped by the KV pool)")
    add_flag(g, "--block-size", type=int, default=16, help="tokens per KV-cache block")
    add_flag(g, "--kv-cache-memory", "--kv-cache-memory-bytes", type=parse_size, default=1 << 30,
             help="bytes for the KV cache on the CPU, e.g. 512MiB; refused below 256 tokens' worth "
                  "(or --max-model-len's) and above the machine's (or its container's) memory")
    add_flag(g, "--num-kv-blocks", "--num-gpu-blocks-override", type=int, default=None,
             help="KV blocks (overrides --kv-cache-memory and --gpu-memory-utilization)")
    add_flag(g, "--gpu-memory-utilization", type=float, default=0.9,
             help="CuPy: fraction of the free device memory for the weights and the KV cache")
    add_flag(g, "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
             help="reuse the KV of shared prompt prefixes")
    add_flag(g, "--policy", "--scheduling-policy", choices=POLICIES, default="fcfs", help="waiting-queue order")
    add_flag(g, "--max-waiting", type=int, default=None,
             help="bound on requests waiting for a free sequence slot (beyond --max-num-seqs); past it: 503 + Retry-After")
    add_flag(g, "--dtype", choices=DTYPES, default="auto",
             help="weights / KV dtype (auto: float32 on the CPU; on CUDA the checkpoint's float16 or bfloat16, "
                  "bfloat16 for GGUF and float32 checkpoints; float16 is refused on the "
                  "CPU, which has no BLAS for it)")
    add_flag(g, "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
             help="K/V cache storage (auto: float16 on the CPU with host kernels, halving KV memory and the "
                  "bytes attention reads, except with --quantization none; else the --dtype)")
    add_flag(g, "--quantization", choices=QUANTIZATIONS, default="auto",
             help="weight format: auto = as stored (GGUF blocks stay quantized and bf16/f16 matrices 16-bit: "
                  "host kernels; on CuPy Q8_0/Q4_0/Q4_1/Q4_K/Q6_K through CUDA kernels, other GGUF types dequantized), "
                  "none = dequantize to float (the exact reference; 16-bit floats stay 16-bit on the CPU), "
                  "q8_0 = quantize every matrix")
    add_flag(g, "--weight-cache", default="auto",
             help="where the CPU kernels' packed weights are kept between loads: auto = $EMBER_WEIGHT_CACHE, else "
                  "~/.cache/ember-cupy/packed-weights (the first load packs into a file there, later loads map it: "
                  "no packing, one copy shared by every server of the model; the 4 most recently used models "
                  "are kept), off, or a directory")
    add_flag(g, "--activation-passes", type=int, choices=(1, 2), default=2,
             help="int8 rows per row of a quantized matmul's input: 2 = x to 16 bits as 255 hi + lo (faithful), "
                  "1 = llama.cpp's single pass (faster batches, less faithful); CuPy: weight-only, unused")
    add_flag(g, "--second-pass-threshold", type=float, default=EngineConfig.second_pass_threshold,
             help="with 2 activation passes: blocks whose d^2 >= this x the row's mean d^2 get 16 bits, the "
                  "others about 8 (0 = all)")
    add_flag(g, "--prompt-activations", choices=("auto", "int8"), default=EngineConfig.prompt_activations,
             help="prompt tokens' matmuls: auto = x and weights in bf16 on AMX-BF16 tiles where the CPU has "
                  "them (~3x faster prefill of K-quant models), else on AVX512-BF16 vectors (Zen 4: "
                  "1.2-1.6x on long prompts), else as --activation-passes; int8 = as generated tokens' "
                  "everywhere")
    add_flag(g, "--deterministic", action="store_true", default=False,
             help="CuPy: the same token ids and logprobs for a request whatever the batch, prefix-cache hits or "
                  "chunk splits, at a cost in speed (every attention row through the decode kernel, every "
                  "quantized matmul through the GEMV); the CPU kernels are deterministic without it")
    add_flag(g, "--speculative-config", default=None,
             help='speculative decoding, as vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
                  '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (prompt lookup) or \'{"model": PATH, '
                  '"num_speculative_tokens": 4}\' (a smaller draft model of the same vocabulary, greedy); drafts '
                  'only where the measured step costs say they pay; the output is the same as without')
    add_flag(g, "--no-progress", action="store_true", default=False, help="no progress bar while loading")


_EPILOG = """\
Every flag can also be set by an EMBER_* environment variable named after it
(--max-num-seqs -> EMBER_MAX_NUM_SEQS); a flag on the command line wins. vLLM's names are
aliases where the meaning matches: --scheduling-policy (--policy), --kv-cache-memory-bytes
(--kv-cache-memory), --num-gpu-blocks-override (--num-kv-blocks), --gpu-memory-utilization.
Backend: EMBER_BACKEND=numpy|cupy (default: cupy when a GPU is usable).

examples:
  ember-cupy serve                          the default model on http://127.0.0.1:8000
  ember-cupy serve path/model.gguf --port 9000 --api-key sekret
  ember-cupy generate "The capital of France is" --max-tokens 16
  ember-cupy chat --system "You are terse."
  ember-cupy serve --help                   the flags of one command
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember-cupy", formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="ember-cupy: a small LLM inference engine (NumPy/C on the "
                                                 "CPU, CuPy on a GPU) with an OpenAI-compatible server.",
                                     epilog=_EPILOG)
    parser.add_argument("--version", action="version", version=f"ember-cupy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (MODEL or --model: default SmolLM2)",
                           description="OpenAI-compatible HTTP server: `ember-cupy serve [MODEL] [flags]`, "
                                       "as `vllm serve MODEL`.")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="a .gguf file or a Hugging Face directory (the same as --model; wins over it)")
    engine_flags(serve)
    server_flags(serve, add_flag)

    sub.add_parser("info", help="backend, host-kernel path and CPU features, as JSON")
    return sampling_commands(sub, parser)



def sampling_commands(sub, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`generate` and `chat`: the engine flags and the sampling ones."""
    for name, text in (("generate", "one-shot generation, streamed to the terminal"),
                       ("chat", "interactive chat with the model's chat template")):
        p = sub.add_parser(name, help=text)
        if name == "generate":
            p.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read stdin)")
        else:
            add_flag(p, "--system", default=None, help="system message")
        engine_flags(p)
        s = p.add_argument_group("sampling")
        add_flag(s, "--max-tokens", type=int, default=256 if name == "generate" else 512)
        add_flag(s, "--temperature", type=float, default=0.7)
        add_flag(s, "--top-p", type=float, default=1.0)
        add_flag(s, "--top-k", type=int, default=0)
        add_flag(s, "--seed", type=int, default=None)
        add_flag(s, "--stop", nargs="+", default=[])
    return parser


def engine_config(args) -> EngineConfig:
    return EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_prefill_tokens=args.max_num_prefill_tokens,
                        max_model_len=args.max_model_len, block_size=args.block_size,
                        kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
                        enable_prefix_caching=args.enable_prefix_caching, policy=args.policy,
                        max_waiting=args.max_waiting, dtype=args.dtype,
                        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                        weight_cache=args.weight_cache,
                        activation_passes=args.activation_passes, second_pass_threshold=args.second_pass_threshold,
                        prompt_activations=args.prompt_activations,
                        gpu_memory_utilization=args.gpu_memory_utilization, deterministic=args.deterministic,
                        speculative_config=args.speculative_config, **_serve_only(args))


def _serve_only(args) -> dict:
    """The engine fields only `serve` has flags for (vLLM's; generate and chat seed each request)."""
    if args.command != "serve":
        return {}
    return {"seed": args.seed, "chat_template": args.chat_template, "generation_config": args.generation_config,
            "override_generation_config": args.override_generation_config}

