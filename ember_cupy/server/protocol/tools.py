"""Shapes of structured outputs and tool calling: response_format, vLLM's structured_outputs,
tools, tool_choice, and the tool calls an assistant makes. Only the shapes: what they mean to
decoding is decided where the constraint is built (protocol/constraints.py)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from ember_cupy.server.protocol.base import ProtocolModel, one_of, present

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"   # OpenAI's rule for function and schema names


class FunctionDefinition(ProtocolModel):
    name: str = Field(pattern=NAME_PATTERN, examples=["get_weather"])
    description: str | None = Field(None, examples=["The current weather in a city"])
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON Schema of the arguments (an object schema).",
        examples=[{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}])
    strict: bool | None = Field(None, description="Arguments must follow `parameters` exactly.",
                                examples=[True])


class Tool(ProtocolModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(ProtocolModel):
    name: str = Field(examples=["get_weather"])


class NamedToolChoice(ProtocolModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = one_of("'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    Literal["none", "auto", "required"], NamedToolChoice)


class JsonSchemaFormat(ProtocolModel):
    name: str = Field(pattern=NAME_PATTERN, examples=["answer"])
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(
        None, alias="schema", description="The JSON Schema the output must follow.",
        examples=[{"type": "object", "properties": {"answer": {"type": "string"}}}])
    strict: bool | None = None


class ResponseFormat(ProtocolModel):
    type: Literal["text", "json_object", "json_schema"] = Field(examples=["json_schema"])
    json_schema: JsonSchemaFormat | None = Field(None, description="Required when type is 'json_schema' (or "
                                                 "'schema' instead).")
    bare_schema: dict[str, Any] | None = Field(
        None, alias="schema", description="llama-server's form: the JSON Schema itself, with type 'json_object' "
        "or 'json_schema'.", examples=[{"type": "object", "properties": {"answer": {"type": "string"}}}])

    @model_validator(mode="after")
    def _one_schema_for_json_schema(self):
        if self.type == "json_schema" and (self.json_schema is None) == (self.bare_schema is None):
            raise ValueError("type 'json_schema' takes 'json_schema' (OpenAI's) or 'schema' (llama-server's), "
                             "exactly one")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError("'json_schema' is allowed only when type is 'json_schema'")
        if self.type == "text" and self.bare_schema is not None:
            raise ValueError("'schema' is allowed only when type is 'json_object' or 'json_schema'")
        return self


JsonSchemaSpec = one_of("a JSON Schema object or its JSON text", dict[str, Any], str)


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar")


class StructuredOutputs(ProtocolModel):
    """vLLM's `structured_outputs`: exactly one constraint on the generated text."""
    model_config = ConfigDict(json_schema_extra={"examples": [{"regex": "[0-9]+"}, {"choice": ["yes", "no"]}],
                                                 "oneOf": [present(kind) for kind in CONSTRAINT_KINDS]})
    json_: JsonSchemaSpec | None = Field(
        None, alias="json", examples=[{"type": "object", "properties": {"n": {"type": "integer"}}}])
    regex: str | None = Field(None, examples=["[0-9]+"])
    choice: list[str] | None = Field(None, min_length=1, examples=[["yes", "no"]])
    grammar: str | None = Field(None, description="A Lark grammar (llguidance's dialect).",
                                examples=['start: "yes" | "no"'])
    disable_additional_properties: bool | None = Field(
        None, description="json: true (the default here; vLLM's is false) reads an object schema that lists "
        "properties without additionalProperties as closed (no other key), as OpenAI's strict mode; false "
        "reads it as JSON Schema does (any other key allowed).")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [kind for kind in CONSTRAINT_KINDS if getattr(self, "json_" if kind == "json" else kind) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'json', 'regex', 'choice' and 'grammar'")
        return self


class ToolCallFunction(ProtocolModel):
    name: str = Field(examples=["get_weather"])
    arguments: str = Field(description="The arguments as JSON text.", examples=['{"city": "Paris"}'])


class ToolCall(ProtocolModel):
    id: str = Field(examples=["call_0"])
    type: Literal["function"] = "function"
    function: ToolCallFunction
