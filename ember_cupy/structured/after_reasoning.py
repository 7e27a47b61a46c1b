"""Structured outputs on a reasoning model (`--reasoning-parser`): the constraint holds the answer,
not the thinking before it, as vLLM applies it after the reasoning ends. The request's constraint
becomes the tail of a Lark grammar whose head is the thinking, a lazy lexeme that ends at the
first `</think>` (llguidance's `[lazy]`: whatever the model thinks, then the answer as asked)."""
from __future__ import annotations

import json

from ember_cupy.reasoning import THINK_END, THINK_START
from ember_cupy.structured.closed_objects import close_objects
from ember_cupy.structured.compiler import JSON_LAYOUT
from ember_cupy.structured.params import ANY_OBJECT_SCHEMA, StructuredOutputsParams


def after_thinking(params: StructuredOutputsParams, thinking_open: bool) -> StructuredOutputsParams:
    """params applied after the reply's thinking; `thinking_open`: the reply starts inside it
    (the prompt opened <think>), else it may open one itself or answer at once."""
    thinking = "thinking[lazy]: /(?s:.*)" + THINK_END.replace("/", "\\/") + "/"
    head = "start: thinking answer" if thinking_open else \
        f"start: ({json.dumps(THINK_START)} thinking)? answer"
    return StructuredOutputsParams(grammar=f"{head}\n{thinking}\nanswer: {_answer(params)}\n")


def _answer(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = ANY_OBJECT_SCHEMA if kind == "json_object" else \
            close_objects(params.json) if params.closes_objects else params.json
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT}, ensure_ascii=False)
    if kind == "regex":
        return "/" + params.regex.replace("/", "\\/") + "/"
    if kind == "choice":
        return " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
    raise ValueError("structured_outputs.grammar cannot be combined with a reasoning parser: "
                     "write the thinking into the grammar and start the server without --reasoning-parser")

