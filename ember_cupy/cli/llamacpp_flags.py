"""llama-server's flags that ember-cupy's own do not already spell, so that a llama.cpp command line
pastes: `ember-cupy serve -m model.gguf -c 4096 -np 4 -t 8 --alias my-model --port 8080`.

Honoured, as the flag of ours they alias: -m (--model), -c / --ctx-size (--max-model-len; 0: the
model's), -np / --parallel (--max-num-seqs), -a / --alias (--served-model-name; commas separate
several), -b / --batch-size (--max-num-batched-tokens), -s (--seed), --chat-template-file
(--chat-template), -to / --timeout (--read-timeout). Set here: -t / --threads (the host kernels'
threads), -ctk / -ctv (the KV cache's storage: f32 or f16, the same for both), and --temp, --top-k,
--top-p, --min-p, --repeat-penalty, -n / --n-predict: the server's defaults for what a request leaves
out (as --override-generation-config). Accepted with no effect, each saying why in --help: -ngl,
-fa, --jinja, --mlock, --no-mmap, -cb, --metrics, --embedding(s), --no-warmup, -ub, --threads-http,
--no-webui, --slots. Any other llama-server flag exits 2 ("unrecognized arguments")."""
from __future__ import annotations

import argparse
import os

KV_TYPES = {"f32": "float32", "f16": "float16"}
# flag -> (its other names, nargs, why it changes nothing here)
NO_EFFECT = {
    "--n-gpu-layers": (("-ngl", "--gpu-layers"), 1, "the whole model runs on the GPU when the backend is CuPy, "
                                                    "on the CPU otherwise"),
    "--flash-attn": (("-fa",), "?", "attention is always the fused paged-attention kernel"),
    "--jinja": ((), 0, "chat templates always run as Jinja"),
    "--mlock": ((), 0, "the packed weights are mapped from the weight cache"),
    "--no-mmap": ((), 0, "the packed weights are mapped from the weight cache"),
    "--cont-batching": (("-cb",), 0, "batching is always continuous"),
    "--metrics": ((), 0, "/metrics is always served"),
    "--embedding": (("--embeddings",), 0, "/v1/embeddings is always served"),
    "--no-warmup": ((), 0, "nothing is run before the first request"),
    "--ubatch-size": (("-ub",), 1, "a step's tokens are bounded by --max-num-batched-tokens"),
    "--threads-http": ((), 1, "the server is one asyncio loop"),
    "--no-webui": ((), 0, "the / page is a small static chat page"),
    "--slots": ((), 0, "there are no slots: every request may run beside the others"),
}
SAMPLING_DEFAULTS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                     "repeat_penalty": "repetition_penalty", "n_predict": "max_new_tokens"}


def _context(text: str) -> int | None:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value or None   # llama-server's 0: the model's own context


def _aliases(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


def llamacpp_flags(parser) -> None:
    g = parser.add_argument_group("llama-server compatibility (honoured)")
    keep = {"default": argparse.SUPPRESS}   # an alias leaves its flag's default alone
    g.add_argument("-m", dest="model", help="--model", **keep)
    g.add_argument("-c", "--ctx-size", dest="max_model_len", type=_context, metavar="N",
                   help="--max-model-len (0: the model's)",
                   **keep)
    g.add_argument("-np", "--parallel", dest="max_num_seqs", type=int, metavar="N", help="--max-num-seqs", **keep)
    g.add_argument("-a", "--alias", dest="served_model_name", type=_aliases, metavar="NAME[,NAME]",
                   help="--served-model-name", **keep)
    g.add_argument("-b", "--batch-size", dest="max_num_batched_tokens", type=int, metavar="N",
                   help="--max-num-batched-tokens",
                   **keep)
    g.add_argument("-s", dest="seed", type=int, metavar="N", help="--seed", **keep)
    g.add_argument("--chat-template-file", dest="chat_template", metavar="FILE", help="--chat-template", **keep)
    g.add_argument("-to", "--timeout", dest="read_timeout", type=float, metavar="SECONDS",
                   help="--read-timeout", **keep)
    g.add_argument("-t", "--threads", dest="llamacpp_threads", type=int, default=None, metavar="N",
                   help="the host kernels' threads (EMBER_NUM_THREADS; <= 0: the CPUs this process may use)")
    for flag in ("-ctk", "-ctv"):
        name = "--cache-type-" + flag[-1]
        g.add_argument(flag, name, dest="llamacpp_" + name[2:].replace("-", "_"), choices=sorted(KV_TYPES),
                       default=None, metavar="f32|f16", help="the KV cache's storage (f32 or f16; -ctk and -ctv alike)")
    for name in SAMPLING_DEFAULTS:
        flag = "--" + name.replace("_", "-")
        extra = ("-n",) if name == "n_predict" else ()
        g.add_argument(flag, *extra, dest="llamacpp_" + name, type=int if name in ("top_k", "n_predict") else float,
                       default=None, metavar="X", help=f"the default {SAMPLING_DEFAULTS[name]} of the requests that leave it out")
    ignored = parser.add_argument_group("llama-server compatibility (accepted, no effect)")
    for flag, (others, nargs, why) in NO_EFFECT.items():
        kind = {"nargs": nargs, "metavar": "X"} if nargs else {"action": "store_true"}
        if flag == "--flash-attn":   # llama-server's on | off | auto (so that it never takes the MODEL)
            kind = {"nargs": "?", "choices": ("on", "off", "auto")}
        ignored.add_argument(flag, *others, dest="llamacpp_ignored_" + flag[2:].replace("-", "_"), help=why, **kind)


def apply_llamacpp_flags(args) -> None:
    """The flags set here (not aliases), onto the settings they stand for; ValueError saying why
    for a value that cannot hold."""
    if getattr(args, "llamacpp_threads", None) and args.llamacpp_threads > 0:
        os.environ["EMBER_NUM_THREADS"] = str(args.llamacpp_threads)
    kinds = {args.llamacpp_cache_type_k, args.llamacpp_cache_type_v} - {None}
    if len(kinds) > 1:
        raise ValueError(f"-ctk {args.llamacpp_cache_type_k} and -ctv {args.llamacpp_cache_type_v}: the K and V "
                         "caches are stored alike here")
    if kinds:
        args.kv_cache_dtype = KV_TYPES[kinds.pop()]
    defaults = {field: getattr(args, "llamacpp_" + name) for name, field in SAMPLING_DEFAULTS.items()
                if getattr(args, "llamacpp_" + name) is not None}
    if defaults.get("max_new_tokens", 1) < 0:    # llama-server's -1: no bound
        del defaults["max_new_tokens"]
    if defaults:
        args.override_generation_config = {**(args.override_generation_config or {}), **defaults}
