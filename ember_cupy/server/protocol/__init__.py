"""The OpenAI protocol as typed models: request bodies (requests.py, messages.py, tools.py),
reply bodies (replies.py), and a validated body -> GenerationRequest (generation.py)."""
from ember_cupy.server.protocol.generation import (GenerationRequest, parse_chat, parse_completion, validate,
                                                   with_sampling_defaults)

__all__ = ["GenerationRequest", "parse_chat", "parse_completion", "validate", "with_sampling_defaults"]
