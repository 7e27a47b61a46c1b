"""The seam between the request's structured-output fields and constrained decoding.

Mapped as vLLM maps them: `response_format` {"type": "json_object"} -> any JSON object,
{"type": "json_schema", "json_schema": {"schema": S}} -> S, {"type": "text"} -> nothing, llama-server's
{"type": "json_object" or "json_schema", "schema": S} -> S; vLLM's
`structured_outputs` -> itself. `tools` / `tool_choice` / `parallel_tool_calls` -> a ToolSpec, whose
constraint (ember_cupy/tool_calls.py) depends on the chat template, so serving builds it.
"""
from __future__ import annotations

from ember_cupy import tool_calls
from ember_cupy.server.errors import bad_request
from ember_cupy.server.protocol.requests import ChatCompletionRequest, CompletionRequest
from ember_cupy.structured import StructuredOutputsParams

ANY_OBJECT = {"type": "object"}


def structured_constraint(request: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The constraint on the generated text that `structured_outputs` or `response_format` asks
    for, or None for free text; a 400 when both are given or a constraint is malformed. (Whether
    the schema, regex or grammar itself is valid is found when it compiles, off the event loop.)"""
    fields = request.structured_outputs
    response_format = getattr(request, "response_format", None)
    try:
        from_format = _from_response_format(response_format) if response_format is not None else None
    except ValueError as exc:   # e.g. a schema over the size limit
        raise bad_request(str(exc), param="response_format") from None
    if fields is not None and from_format is not None:
        raise bad_request("give either 'structured_outputs' or a JSON 'response_format', not both",
                          param="response_format")
    if from_format is not None:
        return from_format
    if fields is None:
        return None
    try:
        return StructuredOutputsParams.from_value(fields.model_dump(by_alias=True, exclude_none=True))
    except ValueError as exc:
        raise bad_request(str(exc), param="structured_outputs") from None


def _from_response_format(response_format) -> StructuredOutputsParams | None:
    if response_format.bare_schema is not None:   # llama-server's {"type": "json_object", "schema": S}
        return StructuredOutputsParams(json=response_format.bare_schema)
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.type == "json_schema":
        schema = response_format.json_schema.json_schema
        return StructuredOutputsParams(json=ANY_OBJECT if schema is None else schema)
    return None


def tool_spec(request: ChatCompletionRequest) -> tool_calls.ToolSpec:
    """The request's tools and tool_choice, checked against each other (a 400 naming the field)."""
    tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
    choice = request.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump()
    try:
        return tool_calls.parse_tools(tools, choice, request.parallel_tool_calls)
    except ValueError as exc:
        param = "tool_choice" if str(exc).startswith("tool_choice") else "tools"
        raise bad_request(str(exc), param=param) from None
