"""The check every configuration and parameter class makes: a ValueError with the caller's message."""
from __future__ import annotations


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
