"""A non-streamed reply of the APIs whose reply objects are made from the engine's outputs as they
come (Ollama's, llama-server's): every output of the request fed to the reply, the engine's and the
constraint's failures as HTTP errors."""
from __future__ import annotations

from ember_cupy.server.async_engine import EngineDeadError, EngineNotReadyError
from ember_cupy.server.errors import APIError, constraint_failed
from ember_cupy.server.request_stream import RequestStream
from ember_cupy.server.serving import engine_error


async def fed_whole(stream: RequestStream, reply) -> list:
    """What reply.feed() made of each output, joined; `reply.failed` (the output constraint failed)
    is a 500, a stream that ended with nothing (the server is stopping) a 503."""
    objects = []
    try:
        async for output in stream:
            objects += reply.feed(output)
    except (EngineDeadError, EngineNotReadyError) as exc:
        raise engine_error(exc) from None
    if reply.failed:
        raise constraint_failed()
    if not objects:
        raise APIError(503, "the request was aborted before it produced anything", code="engine_not_ready")
    return objects
