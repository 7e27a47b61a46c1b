"""`ember-cupy serve | generate | chat | info`. Every flag can also be set by an EMBER_* environment
variable named after it (--max-num-seqs -> EMBER_MAX_NUM_SEQS); a flag on the command line wins.
vLLM's flag names are accepted where the meaning matches (--scheduling-policy, --kv-cache-memory-bytes,
--num-gpu-blocks-override, --gpu-memory-utilization)."""
from __future__ import annotations

import sys

from ember_cupy.cli.flag_values import parse_size
from ember_cupy.cli.flags import build_parser, engine_config
from ember_cupy.cli.loading import ProgressBar
from ember_cupy.cli.serve import served_names, server_settings

__all__ = ["main", "build_parser", "engine_config", "parse_size", "served_names", "server_settings", "ProgressBar"]


def main(argv: list[str] | None = None) -> int:
    from ember_cupy.cli import offline
    from ember_cupy.cli.serve import cmd_serve
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "generate":
            return offline.cmd_generate(args)
        if args.command == "info":
            return offline.cmd_info()
        return offline.cmd_chat(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"ember-cupy: error: {exc}", file=sys.stderr)
        return 2
