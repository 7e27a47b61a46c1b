"""The seam between the request's structured-output fields and constrained decoding."""
from __future__ import annotations

from ember_cupy.server.protocol.requests import ChatCompletionRequest, CompletionRequest


def structured_constraint(request: CompletionRequest | ChatCompletionRequest) -> dict | None:
    """The constraint on the generated text that the request asks for, or None for free text.

    The fields it reads are parsed and shape-checked already: `request.structured_outputs`
    (both endpoints), and on chat `request.response_format`, `request.tools`,
    `request.tool_choice` and `request.parallel_tool_calls`. The engine has no constrained
    decoding yet, so every request decodes free text: this returns None until it has.
    """
    return None
