"""POST /v1/responses (OpenAI's Responses API): the request body and the reply's shapes.

Only the shapes; serving/responses_api.py turns a request into a chat conversation and the
chat path's outputs into response items."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator

from ember_cupy.server.protocol.base import (
    METADATA_DESCRIPTION,
    NULL_IS_ABSENT,
    Integer,
    Metadata,
    ProtocolModel,
    ResponseModel,
    one_of,
)
from ember_cupy.server.protocol.requests import IGNORED
from ember_cupy.server.protocol.tools import NAME_PATTERN

Role = Literal["user", "assistant", "system", "developer"]


# --- input items ---------------------------------------------------------------------------------
class InputTextPart(ProtocolModel):
    type: Literal["input_text", "output_text"] = Field(description="output_text: an assistant message's "
                                                                   "text, as an earlier response gave it.")
    text: str
    annotations: list[Any] | None = Field(None, description=IGNORED)
    logprobs: list[Any] | None = Field(None, description=IGNORED)


InputContent = one_of('a string or an array of text parts ({"type": "input_text", "text": ...})',
                      str, list[InputTextPart])


class InputMessage(ProtocolModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"role": "user", "content": "Hello!"}]})
    type: Literal["message"] = "message"
    role: Role
    content: InputContent
    id: str | None = Field(None, description=IGNORED)
    status: str | None = Field(None, description=IGNORED)


class FunctionCallItem(ProtocolModel):
    """A call the model made earlier (sent back with its output)."""
    type: Literal["function_call"]
    call_id: str = Field(examples=["call_0"])
    name: str = Field(examples=["get_weather"])
    arguments: str = Field(description="The arguments as JSON text.", examples=['{"city": "Paris"}'])
    id: str | None = Field(None, description=IGNORED)
    status: str | None = Field(None, description=IGNORED)


class FunctionCallOutputItem(ProtocolModel):
    """What a function call returned."""
    type: Literal["function_call_output"]
    call_id: str = Field(examples=["call_0"])
    output: str = Field(examples=['{"temperature": 21}'])
    id: str | None = Field(None, description=IGNORED)
    status: str | None = Field(None, description=IGNORED)


def _item_type(item: Any) -> str | None:
    """An item's kind; a message may leave its "type" out (OpenAI's EasyInputMessage)."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                      Discriminator(_item_type, custom_error_type="invalid_item",
                                    custom_error_message="each input item must be a message, a function_call "
                                                         "or a function_call_output")]


def _text_as_message(value: Any) -> Any:
    """input as a string: one user message."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


# --- tools and text format -------------------------------------------------------------------------
class FunctionTool(ProtocolModel):
    """A function the model may call (the Responses API's flat shape)."""
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN, examples=["get_weather"])
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON Schema of the arguments.",
        examples=[{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}])
    strict: bool | None = None


class NamedFunction(ProtocolModel):
    type: Literal["function"]
    name: str = Field(examples=["get_weather"])


ResponsesToolChoice = one_of("'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                             Literal["none", "auto", "required"], NamedFunction)


class TextFormat(ProtocolModel):
    type: Literal["text", "json_object", "json_schema"] = Field(examples=["json_schema"])
    name: str | None = Field(None, pattern=NAME_PATTERN, description="Required with json_schema.",
                             examples=["answer"])
    json_schema: dict[str, Any] | None = Field(None, alias="schema", description="Required with json_schema.",
                                               examples=[{"type": "object"}])
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        is_schema = self.type == "json_schema"
        if is_schema != (self.json_schema is not None) or is_schema != (self.name is not None):
            raise ValueError("'name' and 'schema' are required when type is 'json_schema', and allowed only then")
        return self


class TextConfig(ProtocolModel):
    format: TextFormat | None = Field(None, examples=[{"type": "text"}])
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description=IGNORED)


# --- the request -----------------------------------------------------------------------------------
class ResponsesRequest(ProtocolModel):
    """POST /v1/responses."""
    model_config = ConfigDict(json_schema_extra={"description": NULL_IS_ABSENT})

    model: str | None = Field(None, description="A served model name; the first one when left out.",
                              examples=["SmolLM2-135M-Instruct"])
    input: Annotated[list[InputItem], BeforeValidator(_text_as_message, json_schema_input_type=str | list[InputItem])
                     ] = Field(min_length=1, description="The user's text, or the conversation's items "
                               "(messages, function calls and their outputs), oldest first.", examples=["Hello!"])
    instructions: str | None = Field(None, description="A system message before the input; not carried "
                                                       "over by previous_response_id.", examples=["Be brief."])
    previous_response_id: str | None = Field(None, description="Continue a stored response's conversation.")
    store: bool = Field(True, description="Keep this response for previous_response_id (in memory, bounded).")
    stream: bool = Field(False, description="Reply as server-sent events of typed response.* events.",
                         examples=[True])
    max_output_tokens: Integer | None = Field(None, ge=1, description="Tokens to generate at most.", examples=[4])
    temperature: float = Field(1.0, ge=0, le=2, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    text: TextConfig | None = Field(None, description="format json_schema / json_object: structured output.")
    tools: list[FunctionTool] | None = Field(None, description="Functions the model may call.")
    tool_choice: ResponsesToolChoice | None = Field(None, examples=["auto"])
    parallel_tool_calls: bool | None = Field(None, examples=[False])
    metadata: Metadata | None = Field(None, description="Echoed in the response. " + METADATA_DESCRIPTION,
                                      examples=[{"k": "v"}])
    # fields of OpenAI's Responses API with no effect here
    user: str | None = Field(None, description=IGNORED, examples=["user-1"])
    safety_identifier: str | None = Field(None, description=IGNORED, examples=["user-hash"])
    prompt_cache_key: str | None = Field(None, description=IGNORED, examples=["key"])
    service_tier: str | None = Field(None, description=IGNORED, examples=["auto"])
    truncation: Literal["auto", "disabled"] | None = Field(None, description=IGNORED)
    reasoning: dict[str, Any] | None = Field(None, description=IGNORED, examples=[{}])
    include: list[str] | None = Field(None, description=IGNORED, examples=[[]])
    background: Literal[False] | None = Field(None, description="Only false: responses run in the foreground.")


# --- the reply -------------------------------------------------------------------------------------
class OutputText(ResponseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(ResponseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(ResponseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="The arguments as JSON text.")
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(ResponseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(ResponseModel):
    """A /v1/responses reply; with stream=true the response.* events carry it."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]]
    usage: ResponseUsage | None
    error: dict[str, Any] | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    metadata: dict[str, str]
    truncation: Literal["disabled"]
