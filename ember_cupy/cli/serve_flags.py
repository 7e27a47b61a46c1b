"""`serve`'s own flag groups: the server, reasoning and tool-call parsers, many models (router mode),
data parallel (Ray Serve), vLLM's and llama-server's flags. `add` is flag_values.add_flag; nothing heavy is imported here."""
from __future__ import annotations

from ember_cupy.cli.flag_values import parse_size
from ember_cupy.cli.llamacpp_flags import llamacpp_flags
from ember_cupy.cli.vllm_flags import vllm_flags
from ember_cupy.ray_serve.cli import add_data_parallel_flags   # no ray import: flags only
from ember_cupy.reasoning import PARSERS as REASONING
from ember_cupy.tool_parsers import PARSERS as TOOLS


def server_flags(parser, add) -> None:
    g = parser.add_argument_group("server")
    add(g, "--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    add(g, "--port", type=int, default=8000)
    add(g, "--served-model-name", nargs="+", default=None, help="model name(s) clients use")
    add(g, "--api-key", default=None,
        help="require 'Authorization: Bearer <key>' (scheme in any case) or 'x-api-key: <key>' on /v1/*, /api/*, /tokenize, /detokenize, "
             "/tokenizer_info, /completion, /completions, /apply-template, /props and (--models-dir) "
             "/models/load and /models/unload; /health, /metrics, /version, /openapi.json and the pages / (chat) and /docs "
             "stay public")
    add(g, "--allowed-origins", nargs="+", default=[], help="CORS origins ('*' for any); off when unset")
    add(g, "--max-request-body-bytes", type=parse_size, default=4 << 20, help="larger bodies get 413")
    add(g, "--read-timeout", type=float, default=30.0,
        help="seconds a client may take to send its request headers (also the idle keep-alive timeout), "
             "and again its body (then 408); slower connections are closed")
    add(g, "--max-prompt-tokens-per-request", type=int, default=32768,
        help="prompt tokens of one request, all its prompts or embedding inputs together; more is a 400")
    add(g, "--prepare-timeout", type=float, default=30.0,
        help="seconds a request's tokenizing, chat template and grammar compile may take, waiting for a "
             "worker thread included (then 408)")
    add(g, "--response-store-bytes", type=parse_size, default=64 << 20,
        help="JSON bytes of the /v1/responses kept for previous_response_id (bodies and conversations, "
             "all together; the least recently used go first)")
    add(g, "--drain-timeout", type=float, default=10.0,
        help="on SIGINT/SIGTERM, seconds in-flight requests may finish before being aborted")
    add(g, "--stream-stall-timeout", type=float, default=60.0,
        help="seconds a streaming client may leave output unread (not reading its connection) "
             "before its request is aborted and its KV cache freed (default: 60)")
    add(g, "--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _output_parser_flags(parser, add)
    _router_flags(parser, add)
    add_data_parallel_flags(parser, add)
    vllm_flags(parser, add)
    llamacpp_flags(parser)


def _output_parser_flags(parser, add) -> None:
    """vLLM's names."""
    g = parser.add_argument_group("reasoning and tool calls")
    add(g, "--reasoning-parser", choices=REASONING, default=None,
        help="split <think>...</think> into reasoning_content (chat), reasoning items (/v1/responses) "
             "and thinking blocks (/v1/messages); structured outputs then hold the answer only")
    add(g, "--tool-call-parser", choices=sorted(TOOLS), default=None,
        help="the model family's tool-call format for tool_choice auto on a template with tools "
             "(default: hermes); required and named tool choices stay constrained JSON")
    add(g, "--enable-auto-tool-choice", action="store_true", default=False,
        help="vLLM's switch for tool_choice auto: accepted; auto is always on here")


def _router_flags(parser, add) -> None:
    """`serve`'s flags for many models (llama.cpp's router names)."""
    g = parser.add_argument_group("many models (router mode)")
    add(g, "--models-dir", default=None,
        help="serve every .gguf file and Hugging Face folder in this directory, each loaded on its first "
             "request (503 + Retry-After while it loads); the engine flags apply to each")
    add(g, "--models-max", type=int, default=4, help="models loaded at once; the least recently used idle one "
                                                       "unloads for another")
    add(g, "--models-idle-ttl", type=float, default=None, help="seconds after which an idle model unloads")
    add(g, "--models-memory", type=parse_size, default=None,
        help="bytes for all models' weights and KV caches together, e.g. 8GiB (default: the machine's memory, "
             "or its container's limit)")
