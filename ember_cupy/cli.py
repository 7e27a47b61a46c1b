"""`ember-cupy serve | generate | chat | info`. Every flag can also be set by an EMBER_* environment
variable named after it (--max-num-seqs -> EMBER_MAX_NUM_SEQS); a flag on the command line wins.
vLLM's flag names are accepted where the meaning matches (--scheduling-policy, --kv-cache-memory-bytes,
--num-gpu-blocks-override, --gpu-memory-utilization)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import sys
import time

from ember_cupy.config import CPU_MAX_NUM_PREFILL_TOKENS, DTYPES, KV_CACHE_DTYPES, POLICIES, QUANTIZATIONS, EngineConfig
from ember_cupy.version import __version__

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '1G', '1.5GB' (K/M/G/T are binary multiples)."""
    match = _SIZE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 512MiB, 2G)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * (1 << (10 * "_kmgt".index(unit or "_"))))


def parse_bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _env_name(flag: str) -> str:
    return "EMBER_" + flag.lstrip("-").replace("-", "_").upper()


def _add(parser: argparse.ArgumentParser, flag: str, *aliases: str, **kwargs) -> None:
    """add_argument(flag, *aliases) whose default comes from EMBER_<FLAG> when that is set."""
    env = _env_name(flag)
    kwargs["help"] = f"{kwargs.get('help', '')} [env {env}]".strip()
    if env in os.environ:
        raw = os.environ[env]
        try:
            if kwargs.get("action") in (argparse.BooleanOptionalAction, "store_true"):
                kwargs["default"] = parse_bool(raw)
            elif kwargs.get("nargs") in ("+", "*"):
                kwargs["default"] = [kwargs.get("type", str)(v) for v in raw.replace(",", " ").split()]
            else:
                kwargs["default"] = kwargs.get("type", str)(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise SystemExit(f"ember-cupy: error: {env}={raw!r}: {exc}") from None
    parser.add_argument(flag, *aliases, **kwargs)


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine")
    _add(g, "--model", default=None, help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct)")
    _add(g, "--max-num-seqs", type=int, default=64, help="sequences per step")
    _add(g, "--max-num-batched-tokens", type=int, default=1024, help="tokens per step")
    _add(g, "--max-num-prefill-tokens", type=int, default=None,
         help=f"prompt tokens per step, which bound a step's time and so the wait of a request that "
              f"arrives during a long prefill (default: {CPU_MAX_NUM_PREFILL_TOKENS} on the CPU, "
              f"--max-num-batched-tokens on CUDA)")
    _add(g, "--max-model-len", type=int, default=None, help="context length (default: the model's, capped by the KV pool)")
    _add(g, "--block-size", type=int, default=16, help="tokens per KV-cache block")
    _add(g, "--kv-cache-memory", "--kv-cache-memory-bytes", type=parse_size, default=1 << 30,
         help="bytes for the KV cache on the CPU, e.g. 512MiB; refused below 256 tokens' worth "
              "(or --max-model-len's)")
    _add(g, "--num-kv-blocks", "--num-gpu-blocks-override", type=int, default=None,
         help="KV blocks (overrides --kv-cache-memory and --gpu-memory-utilization)")
    _add(g, "--gpu-memory-utilization", type=float, default=0.9,
         help="CuPy: fraction of the free device memory for the weights and the KV cache")
    _add(g, "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
         help="reuse the KV of shared prompt prefixes")
    _add(g, "--policy", "--scheduling-policy", choices=POLICIES, default="fcfs", help="waiting-queue order")
    _add(g, "--max-waiting", type=int, default=None,
         help="bound on requests waiting for a free sequence slot (beyond --max-num-seqs); past it: 503 + Retry-After")
    _add(g, "--dtype", choices=DTYPES, default="auto",
         help="weights / KV dtype (auto: float32 on the CPU; on CUDA the checkpoint's float16 or bfloat16, "
              "bfloat16 for GGUF and float32 checkpoints; float16 is refused on the "
              "CPU, which has no BLAS for it)")
    _add(g, "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
         help="K/V cache storage (auto: float16 on the CPU with host kernels, halving KV memory and the "
              "bytes attention reads, except with --quantization none; else the --dtype)")
    _add(g, "--quantization", choices=QUANTIZATIONS, default="auto",
         help="weight format: auto = as stored (GGUF blocks stay quantized: host kernels; on CuPy "
              "Q8_0/Q4_0/Q4_1 through CUDA kernels, other GGUF types dequantized), "
              "none = dequantize to float (the exact reference), q8_0 = quantize every matrix")
    _add(g, "--activation-passes", type=int, choices=(1, 2), default=2,
         help="int8 passes over a quantized matmul's input: 2 = value + residual (~14 bits, faithful), "
              "1 = llama.cpp's single pass (faster batches, less faithful); CuPy: weight-only, unused")
    _add(g, "--second-pass-threshold", type=float, default=EngineConfig.second_pass_threshold,
         help="with 2 activation passes: blocks whose d^2 >= this x the row's mean d^2 get the second (0 = all)")
    _add(g, "--deterministic", action="store_true", default=False,
         help="CuPy: the same token ids and logprobs for a request whatever the batch, prefix-cache hits or "
              "chunk splits, at a cost in speed (every attention row through the decode kernel, every "
              "quantized matmul through the GEMV); the CPU kernels are deterministic without it")
    _add(g, "--no-progress", action="store_true", default=False, help="no progress bar while loading")


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
    _engine_flags(serve)
    g = serve.add_argument_group("server")
    _add(g, "--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    _add(g, "--port", type=int, default=8000)
    _add(g, "--served-model-name", nargs="+", default=None, help="model name(s) clients use")
    _add(g, "--api-key", default=None,
         help="require 'Authorization: Bearer <key>' (scheme in any case) on /v1/*, /tokenize, /detokenize and "
              "/tokenizer_info; /health, /metrics, /version, /openapi.json and the pages / (chat) and /docs "
              "stay public")
    _add(g, "--allowed-origins", nargs="+", default=[], help="CORS origins ('*' for any); off when unset")
    _add(g, "--max-request-body-bytes", type=parse_size, default=4 << 20, help="larger bodies get 413")
    _add(g, "--read-timeout", type=float, default=30.0,
         help="seconds a client may take to send its request headers (also the idle keep-alive timeout), "
              "and again its body (then 408); slower connections are closed")
    _add(g, "--max-prompt-tokens-per-request", type=int, default=32768,
         help="prompt tokens of one request, all its prompts or embedding inputs together; more is a 400")
    _add(g, "--prepare-timeout", type=float, default=30.0,
         help="seconds a request's tokenizing, chat template and grammar compile may take, waiting for a "
              "worker thread included (then 408)")
    _add(g, "--response-store-bytes", type=parse_size, default=64 << 20,
         help="JSON bytes of the /v1/responses kept for previous_response_id (bodies and conversations, "
              "all together; the least recently used go first)")
    _add(g, "--drain-timeout", type=float, default=10.0,
         help="on SIGINT/SIGTERM, seconds in-flight requests may finish before being aborted")
    _add(g, "--stream-stall-timeout", type=float, default=60.0,
         help="seconds a streaming client may leave output unread (not reading its connection) "
              "before its request is aborted and its KV cache freed (default: 60)")
    _add(g, "--log-level", default="info", choices=["debug", "info", "warning", "error"])
    from ember_cupy.ray_serve.cli import add_data_parallel_flags   # no ray import: flags only
    add_data_parallel_flags(serve, _add)

    sub.add_parser("info", help="backend, host-kernel path and CPU features, as JSON")
    return _sampling_commands(sub, parser)


def _sampling_commands(sub, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`generate` and `chat`: the engine flags and the sampling ones."""
    for name, text in (("generate", "one-shot generation, streamed to the terminal"),
                       ("chat", "interactive chat with the model's chat template")):
        p = sub.add_parser(name, help=text)
        if name == "generate":
            p.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read stdin)")
        else:
            _add(p, "--system", default=None, help="system message")
        _engine_flags(p)
        s = p.add_argument_group("sampling")
        _add(s, "--max-tokens", type=int, default=256 if name == "generate" else 512)
        _add(s, "--temperature", type=float, default=0.7)
        _add(s, "--top-p", type=float, default=1.0)
        _add(s, "--top-k", type=int, default=0)
        _add(s, "--seed", type=int, default=None)
        _add(s, "--stop", nargs="+", default=[])
    return parser


def engine_config(args) -> EngineConfig:
    return EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_prefill_tokens=args.max_num_prefill_tokens,
                        max_model_len=args.max_model_len, block_size=args.block_size,
                        kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
                        enable_prefix_caching=args.enable_prefix_caching, policy=args.policy,
                        max_waiting=args.max_waiting, dtype=args.dtype,
                        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                        activation_passes=args.activation_passes, second_pass_threshold=args.second_pass_threshold,
                        gpu_memory_utilization=args.gpu_memory_utilization, deterministic=args.deterministic)


class ProgressBar:
    """A one-line loading bar on stderr: (done, total) callbacks from the loader."""

    def __init__(self, label: str = "Loading model", stream=None, width: int = 30):
        stream = stream or sys.stderr
        self.label, self.stream, self.width = label, stream, width
        self.tty = stream.isatty()
        self.start = time.monotonic()
        self._last_percent = -1

    def __call__(self, done: int, total: int) -> None:
        percent = int(100 * done / total) if total else 100
        if percent == self._last_percent or (not self.tty and percent not in (0, 100)):
            return
        self._last_percent = percent
        filled = self.width * percent // 100
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {percent:3d}% "
                f"({done}/{total}) {time.monotonic() - self.start:.1f}s")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and done >= total:
            self.stream.write("\n")
        self.stream.flush()


def check_dtype(args) -> None:
    """A --dtype the backend cannot serve (float16 on NumPy) fails here, before the model loads."""
    from ember_cupy.backend import get_xp
    from ember_cupy.engine.model_runner import resolve_dtype
    resolve_dtype(args.dtype, get_xp())


def _load_engine(args):
    from ember_cupy.engine.llm_engine import LLMEngine
    check_dtype(args)
    progress = None if args.no_progress else ProgressBar()
    return LLMEngine(args.model, engine_config(args), progress=progress)


def served_names(args) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model:
        base = os.path.basename(os.path.normpath(args.model))
        return [base.removesuffix(".gguf")]
    return ["SmolLM2-135M-Instruct"]


def check_serve_args(args) -> None:
    """Everything that would fail only after the server is up fails here, as one line: the
    model's path, the port, the dtype, the engine flags, an address already in use."""
    from ember_cupy.model.loader import resolve_model_path
    from ember_cupy.server.launcher import check_can_listen
    if args.model_tag is not None:
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_prompt_tokens_per_request < 1:
        raise ValueError(f"--max-prompt-tokens-per-request must be >= 1, got {args.max_prompt_tokens_per_request}")
    if not args.prepare_timeout > 0:
        raise ValueError(f"--prepare-timeout must be > 0 seconds, got {args.prepare_timeout}")
    resolve_model_path(args.model)
    engine_config(args)
    check_dtype(args)
    check_can_listen(args.host, args.port)


def server_settings(args):
    """The ServerSettings of `serve`'s flags (the plain server's, or the Ray ingress's)."""
    from ember_cupy.server import ServerSettings
    return ServerSettings(host=args.host, port=args.port, served_model_names=served_names(args),
                          api_key=args.api_key or None, allowed_origins=list(args.allowed_origins or []),
                          max_body_bytes=args.max_request_body_bytes, drain_timeout=args.drain_timeout,
                          read_timeout=args.read_timeout, response_store_bytes=args.response_store_bytes,
                          max_prompt_tokens_per_request=args.max_prompt_tokens_per_request,
                          model_path=args.model)


def cmd_serve(args) -> int:
    from ember_cupy.server import AsyncEngine, EngineMetrics, serve
    check_serve_args(args)   # before logging is set up and before the socket opens
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = server_settings(args)
    names = settings.served_model_names
    from ember_cupy.ray_serve import cli as ray_cli
    if ray_cli.uses_ray(args):   # --data-parallel-backend ray: replicas on Ray Serve
        return ray_cli.run(args, engine_config(args), settings)
    engine = AsyncEngine(factory=lambda: _load_engine(args), metrics=EngineMetrics(names[0]),
                         max_waiting=args.max_waiting, stream_stall_timeout=args.stream_stall_timeout,
                         prepare_timeout=args.prepare_timeout)
    return asyncio.run(serve(engine, settings))


def _sampling(args):
    from ember_cupy.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))


def _stream(engine, request_id: str, prompt, params, out=None) -> tuple[int, float]:
    """Run one request, printing text as it comes; returns (tokens, seconds)."""
    out = out or sys.stdout
    start = time.monotonic()
    engine.add_request(request_id, prompt, params)
    tokens = 0
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                completion = output.outputs[0]
                tokens += len(completion.delta_token_ids)
                out.write(completion.delta_text)
                out.flush()
    except KeyboardInterrupt:
        engine.abort(request_id)
        out.write(" [interrupted]")
    out.write("\n")
    return tokens, time.monotonic() - start


def cmd_generate(args) -> int:
    params = _sampling(args)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    engine = _load_engine(args)
    tokens, seconds = _stream(engine, "generate-0", prompt, params)
    print(f"[{tokens} tokens in {seconds:.2f}s, {tokens / max(seconds, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


CHAT_HISTORY = os.path.join("~", ".cache", "ember_cupy", "chat_history")


def _line_editing(path: str):
    """readline for input(): arrow keys, editing, history (kept in `path` between sessions).
    Returns the function that saves the history, or None where readline is missing."""
    try:
        import readline
    except ImportError:   # Windows without pyreadline: plain input()
        return None
    path = os.path.expanduser(path)
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save() -> None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass
    return save


def cmd_chat(args) -> int:
    params = _sampling(args)
    engine = _load_engine(args)
    save_history = _line_editing(CHAT_HISTORY)
    try:
        return _chat_loop(engine, args.system, params)
    finally:
        if save_history:
            save_history()


def _chat_loop(engine, system_prompt: str | None, params) -> int:
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages = list(system)
    print("chat with the model; /reset clears the conversation, Ctrl-D quits", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = list(system)
            print("[conversation reset" + (": the system message is kept]" if system else "]"), file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        reply = _Capture(sys.stdout)
        _stream(engine, f"chat-{turn}", prompt, params, out=reply)
        messages.append({"role": "assistant", "content": reply.text})
        turn += 1


class _Capture:
    def __init__(self, out):
        self.out, self.text = out, ""

    def write(self, text: str) -> None:
        if text != "\n" or self.text:
            self.text += text
        self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def cmd_info() -> int:
    import json
    from ember_cupy.info import runtime_info
    print(json.dumps(runtime_info(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "info":
            return cmd_info()
        return cmd_chat(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"ember-cupy: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
