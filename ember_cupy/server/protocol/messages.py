"""Chat messages as a request carries them; they go to the model's chat template as dicts."""
from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from ember_cupy.server.protocol.base import ProtocolModel, one_of, present
from ember_cupy.server.protocol.tools import ToolCall


class TextPart(ProtocolModel):
    type: Literal["text"]
    text: str


MessageContent = one_of("a string or an array of text parts ({\"type\": \"text\", \"text\": ...})",
                        str, list[TextPart])


class ChatMessage(ProtocolModel):
    """One message. `tool_calls` only on assistant messages (whose content may then be left out),
    `tool_call_id` on tool messages and only there."""
    model_config = ConfigDict(json_schema_extra={
        "examples": [{"role": "user", "content": "Hello!"}],
        # the role rules of _fields_fit_the_role, for clients that validate against the spec
        "allOf": [
            {"if": {"not": {"properties": {"role": {"const": "assistant"}}}}, "then": present("content")},
            {"if": present("tool_calls"), "then": {"properties": {"role": {"const": "assistant"}}}},
            {"if": {"properties": {"role": {"const": "tool"}}}, "then": present("tool_call_id"),
             "else": {"not": present("tool_call_id")}},
        ]})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: MessageContent | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _fields_fit_the_role(self):
        if self.content is None and not (self.role == "assistant"):
            raise ValueError(f"a '{self.role}' message needs 'content'")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("'tool_calls' are allowed only in assistant messages")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("'tool_call_id' is required in tool messages and allowed only there")
        return self

    def template_dict(self) -> dict:
        """The message as the chat template reads it (fields left out stay out)."""
        return self.model_dump(exclude_none=True, by_alias=True)


Messages = list[ChatMessage]
MESSAGES_FIELD = Field(min_length=1, description="The conversation so far, oldest first.")
