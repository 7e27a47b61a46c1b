"""The OpenAI-compatible HTTP server (aiohttp) and the asyncio engine loop behind it."""
from ember_cupy.server.api import ServerSettings, build_app
from ember_cupy.server.async_engine import (AsyncEngine, EngineDeadError, EngineNotReadyError,
                                            EngineOverloadedError, EngineState)
from ember_cupy.server.launcher import BackgroundServer, Server, serve
from ember_cupy.server.metrics import EngineMetrics
from ember_cupy.server.request_stream import RequestStream

__all__ = ["AsyncEngine", "BackgroundServer", "EngineDeadError", "EngineMetrics", "EngineNotReadyError",
           "EngineOverloadedError", "EngineState", "RequestStream", "Server", "ServerSettings", "build_app",
           "serve"]
