"""Flag values: sizes and booleans as text, and add_flag, add_argument with its default from the
environment (--max-num-seqs -> EMBER_MAX_NUM_SEQS; a flag on the command line wins)."""
from __future__ import annotations

import argparse
import os
import re

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


def env_name(flag: str) -> str:
    return "EMBER_" + flag.lstrip("-").replace("-", "_").upper()


def add_flag(parser: argparse.ArgumentParser, flag: str, *aliases: str, **kwargs) -> None:
    """add_argument(flag, *aliases) whose default comes from EMBER_<FLAG> when that is set."""
    env = env_name(flag)
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
