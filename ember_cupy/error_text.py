"""Error text cut to one bounded line, for a client or a log line (server errors, grammar refusals)."""
from __future__ import annotations

import re

MAX_MESSAGE_CHARS = 500
# what libraries wrap around a message: a Python traceback's header, a Rust panic's location and
# its backtrace hint (the panic's own message is kept)
_WRAPPING = re.compile(r"Traceback \(most recent call last\):|thread '[^']*' panicked at \S*"
                       r"|note: run with `RUST_BACKTRACE=\S*.*|stack backtrace:")
_NUMBERED_ECHO = re.compile(r"^\d+ \| ")   # a parser quoting the input's line N


def one_line(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """An error message as one line of at most `limit` characters: the first line and every later
    line that is not indented (tracebacks' frames, a parser's echo of the input and its caret
    line are) nor a numbered echo of the input, without traceback or panic wrapping, joined by ': '."""
    lines = str(text).splitlines() or [""]
    kept = [lines[0]] + [line for line in lines[1:]
                         if line and not line[0].isspace() and not _NUMBERED_ECHO.match(line)]
    parts = [_WRAPPING.sub("", line).strip().rstrip(":").strip() for line in kept]
    message = ": ".join(p for p in parts if p and set(p) - set("^~ ")) or "error"
    return message if len(message) <= limit else message[:limit - 3] + "..."
