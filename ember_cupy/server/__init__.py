"""The OpenAI-compatible HTTP server (aiohttp) and the asyncio engine loop behind it.

The names below are imported on first use (PEP 562), so that importing one light module of the
package (thread_policy) does not import aiohttp and the protocol's pydantic models (~0.35 s):
`serve` loads the model while they import (ember_cupy/cli/serve.py)."""
from __future__ import annotations

import importlib

_HOMES = {"ServerSettings": "api", "build_app": "api", "AsyncEngine": "async_engine",
          "EngineDeadError": "async_engine", "EngineNotReadyError": "async_engine",
          "EngineOverloadedError": "async_engine", "EngineState": "async_engine",
          "BackgroundServer": "launcher", "Server": "launcher", "serve": "launcher",
          "EngineMetrics": "metrics", "RequestStream": "request_stream"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
