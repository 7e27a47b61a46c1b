"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): the request bodies
and the reply's shapes. Only the shapes: server/messages_chat.py maps a request onto chat."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator

from ember_cupy.server.protocol.base import NULL_IS_ABSENT, Integer, ProtocolModel, ResponseModel, one_of
from ember_cupy.server.protocol.requests import IGNORED, StopList
from ember_cupy.server.protocol.tools import NAME_PATTERN

CACHE_CONTROL = Field(None, description=IGNORED + " (prefixes are cached anyway)", examples=[{"type": "ephemeral"}])


# --- content blocks ------------------------------------------------------------------------------
class AnthropicTextBlock(ProtocolModel):
    type: Literal["text"]
    text: str = Field(examples=["Hello!"])
    cache_control: dict[str, Any] | None = CACHE_CONTROL
    citations: list[Any] | None = Field(None, description=IGNORED, examples=[[]])


class AnthropicToolUseBlock(ProtocolModel):
    """A call the assistant made earlier (sent back with its result)."""
    type: Literal["tool_use"]
    id: str = Field(examples=["toolu_0"])
    name: str = Field(examples=["get_weather"])
    input: dict[str, Any] = Field(description="The arguments.", examples=[{"city": "Paris"}])
    cache_control: dict[str, Any] | None = CACHE_CONTROL


ToolResultContent = one_of('a string or an array of text blocks ({"type": "text", "text": ...})',
                           str, list[AnthropicTextBlock])


class AnthropicToolResultBlock(ProtocolModel):
    """What a tool call returned: a user message's blocks, before its text."""
    type: Literal["tool_result"]
    tool_use_id: str = Field(examples=["toolu_0"])
    content: ToolResultContent | None = Field(None, examples=['{"temperature": 21}'])
    is_error: bool = Field(False, description='The call failed: its content is shown after "Error: ".')
    cache_control: dict[str, Any] | None = CACHE_CONTROL


class AnthropicThinkingBlock(ProtocolModel):
    """An earlier reply's thinking: accepted in assistant messages and left out of the prompt."""
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class AnthropicRedactedThinkingBlock(ProtocolModel):
    type: Literal["redacted_thinking"]
    data: str


def _block_type(block: Any) -> str | None:
    return block.get("type") if isinstance(block, dict) else getattr(block, "type", None)


ContentBlock = Annotated[
    Annotated[AnthropicTextBlock, Tag("text")] | Annotated[AnthropicToolUseBlock, Tag("tool_use")]
    | Annotated[AnthropicToolResultBlock, Tag("tool_result")] | Annotated[AnthropicThinkingBlock, Tag("thinking")]
    | Annotated[AnthropicRedactedThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_block_type, custom_error_type="invalid_block",
                  custom_error_message="a content block must be text, tool_use, tool_result or thinking: image "
                                       "and document blocks are not supported (the served model reads text only)")]


def _text_as_block(value: Any) -> Any:
    """content as a string: one text block."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or an array of content blocks")
    return value


class AnthropicMessage(ProtocolModel):
    """One turn. tool_use blocks only in assistant messages, tool_result blocks only in user ones."""
    model_config = ConfigDict(json_schema_extra={"examples": [{"role": "user", "content": "Hello!"}]})
    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlock], BeforeValidator(
        _text_as_block, json_schema_input_type=str | list[ContentBlock])] = Field(examples=["Hello!"])

    @model_validator(mode="after")
    def _blocks_fit_the_role(self):
        kinds = {block.type for block in self.content}
        if self.role == "user" and kinds & {"tool_use", "thinking", "redacted_thinking"}:
            raise ValueError("tool_use and thinking blocks are allowed only in assistant messages")
        if self.role == "assistant" and "tool_result" in kinds:
            raise ValueError("tool_result blocks are allowed only in user messages")
        return self


System = one_of('a string or an array of text blocks ({"type": "text", "text": ...})', str, list[AnthropicTextBlock])


# --- tools ---------------------------------------------------------------------------------------
class AnthropicTool(ProtocolModel):
    """A client tool (Anthropic's server tools, such as web search, are not served)."""
    name: str = Field(pattern=NAME_PATTERN, examples=["get_weather"])
    description: str | None = Field(None, examples=["The weather in a city"])
    input_schema: dict[str, Any] = Field(
        description="A JSON Schema of the input (an object schema).",
        examples=[{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}])
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = CACHE_CONTROL


PARALLEL = Field(None, description="true: at most one tool call in the reply.")


class ToolChoiceAuto(ProtocolModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = PARALLEL


class ToolChoiceAny(ProtocolModel):
    """Call one of the tools (or several)."""
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = PARALLEL


class ToolChoiceTool(ProtocolModel):
    """Call this tool: its input is held to its input_schema."""
    type: Literal["tool"]
    name: str = Field(examples=["get_weather"])
    disable_parallel_tool_use: bool | None = PARALLEL


class ToolChoiceNone(ProtocolModel):
    type: Literal["none"]


AnthropicToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                                Field(discriminator="type")]


class JsonOutputFormat(ProtocolModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema", description="The JSON Schema the text must follow.",
                                        examples=[{"type": "object", "properties": {"answer": {"type": "string"}}}])


class OutputConfig(ProtocolModel):
    format: JsonOutputFormat | None = Field(None, description="Structured output: the reply's text is held to "
                                                              "the schema.")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(None, description=IGNORED)


class AnthropicMetadata(ProtocolModel):
    user_id: str | None = Field(None, max_length=256, description=IGNORED, examples=["user-1"])


# --- the requests --------------------------------------------------------------------------------
class CountTokensRequest(ProtocolModel):
    """POST /v1/messages/count_tokens: the prompt a /v1/messages request with these fields makes."""
    model_config = ConfigDict(json_schema_extra={"description": NULL_IS_ABSENT})

    model: str = Field(description="A served model name.", examples=["SmolLM2-135M-Instruct"])
    messages: list[AnthropicMessage] = Field(min_length=1, description="The conversation so far, oldest first; "
                                             "the last one the user's (no assistant prefill).")
    system: System | None = Field(None, description="A system prompt before the messages.",
                                  examples=["Be brief."])
    tools: list[AnthropicTool] | None = Field(None, description="Tools the model may call.")
    tool_choice: AnthropicToolChoice | None = Field(None, description="auto (the default with tools), any, tool "
                                                    "or none; any and tool need tools.", examples=[{"type": "none"}])
    output_config: OutputConfig | None = Field(None, examples=[{"format": {"type": "json_schema", "schema": {
        "type": "object"}}}])
    thinking: dict[str, Any] | None = Field(
        None, description=IGNORED + " A --reasoning-parser server splits the thinking of models that think.",
        examples=[{"type": "enabled", "budget_tokens": 1024}])
    cache_control: dict[str, Any] | None = CACHE_CONTROL

    @model_validator(mode="after")
    def _the_last_turn_is_the_users(self):
        if self.messages[-1].role != "user":
            raise ValueError("the last message must be the user's: a final assistant message (a prefill to "
                             "continue) is not supported, the reply is always a new assistant turn")
        return self


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""
    model_config = ConfigDict(json_schema_extra={"description": NULL_IS_ABSENT})

    max_tokens: Integer = Field(ge=1, description="Tokens to generate at most.", examples=[4])
    stop_sequences: StopList | None = Field(None, description="Strings that end the text (not included in it).",
                                            examples=[["\n\n"]])
    temperature: float | None = Field(None, ge=0, le=1, description="0 = greedy; left out: the model's "
                                      "default (--generation-config), else 1.", examples=[0.7])
    top_p: float | None = Field(None, gt=0, le=1, examples=[0.9])
    top_k: Integer | None = Field(None, ge=0, description="0 = no top-k.", examples=[40])
    stream: bool = Field(False, description="Reply as Anthropic's server-sent events (message_start ... "
                                            "message_stop).", examples=[True])
    metadata: AnthropicMetadata | None = Field(None, examples=[{"user_id": "user-1"}])
    service_tier: str | None = Field(None, description=IGNORED, examples=["auto"])


# --- the reply -----------------------------------------------------------------------------------
class TextContent(ResponseModel):
    type: Literal["text"]
    text: str


class ToolUseContent(ResponseModel):
    type: Literal["tool_use"]
    id: str = Field(description="toolu_...: the tool_use_id of its tool_result.")
    name: str
    input: dict[str, Any]


class ThinkingContent(ResponseModel):
    """A --reasoning-parser server's split of the model's thinking."""
    type: Literal["thinking"]
    thinking: str
    signature: str = Field(description="Always empty here.")


class MessageUsage(ResponseModel):
    input_tokens: int = Field(description="The prompt's tokens (those served from the prefix cache included).")
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(ResponseModel):
    """A /v1/messages reply; with stream=true the events message_start (this, without content),
    content_block_start / ping / content_block_delta / content_block_stop per block, message_delta
    (stop_reason, usage.output_tokens) and message_stop carry it."""
    id: str = Field(description="msg_...")
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[Annotated[TextContent | ToolUseContent | ThinkingContent, Field(discriminator="type")]]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class CountTokensResponse(ResponseModel):
    input_tokens: int


class AnthropicErrorInfo(ResponseModel):
    type: Literal["invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                  "request_too_large", "rate_limit_error", "timeout_error", "api_error", "overloaded_error"]
    message: str


class AnthropicErrorResponse(ResponseModel):
    """Every error of the /v1/messages routes, in Anthropic's shape."""
    type: Literal["error"]
    error: AnthropicErrorInfo
