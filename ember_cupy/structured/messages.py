"""llguidance's error text cut to what a client or a log line should see.

Its errors may go on with the parser state (`<state>`), the whole grammar (`<grammar>`, up to the
1 MiB a client may send) or a Rust backtrace (`<backtrace>`), and a first line may quote a regex
whole, or echo the input with a caret; `brief` keeps the text before those sections, without
the echo (error_text.one_line), on one line, at most MAX_CHARS long.
"""
from __future__ import annotations

from ember_cupy.error_text import one_line

MAX_CHARS = 300
_SECTIONS = ("<state>", "<grammar>", "<backtrace>", "\nstack backtrace:")


def brief(message: str, max_chars: int = MAX_CHARS) -> str:
    """The head of an llguidance error: one line of at most max_chars characters."""
    for marker in _SECTIONS:
        message = message.split(marker, 1)[0]
    text = " ".join(one_line(message, limit=len(message) + 5).split())
    if text.startswith("panic: "):   # a Rust assertion: say what failed, not where in the Rust
        text = "the grammar compiler refused it: " + text[len("panic: "):]
    if len(text) > max_chars:
        text = text[:max_chars - 3].rstrip() + "..."
    return text or "the grammar compiler refused it"
