"""Ollama's error shape, which the /api/ routes answer in (its clients read it): {"error": message},
with the HTTP status as on the OpenAI routes."""
from __future__ import annotations

from ember_cupy.server.errors import APIError

OLLAMA_PREFIX = "/api/"


def speaks_ollama(path: str) -> bool:
    return path.startswith(OLLAMA_PREFIX)


def error_body(error: APIError) -> dict:
    return {"error": error.message}
