"""Tool calling: OpenAI `tools` / `tool_choice` -> prompt and output constraint, output -> tool calls.

The generic format, for chat templates without tool support (the default SmolLM2's):
- the tools are described in the system message, with the reply format;
- a call is written as a JSON array `[{"name": "<function>", "arguments": {...}}, ...]`;
- the output is constrained by a grammar built from the tools' parameters:
  `required`: exactly such an array (one item when parallel_tool_calls is false);
  a named function: that function's arguments object alone;
  `auto`: a top-level choice between such an array and plain text that does not start with "["
  or white space, so whatever the model writes parses one way or the other;
  `none`: nothing (the tools are not even described).
- assistant messages with tool_calls go back into the prompt in the same array format, and
  role "tool" messages as they are (the template renders their content).

Templates with tool support (their source uses `tools`) get the tools through the template and
the messages unchanged; for `auto` their output is free text, parsed by the family's format
(`--tool-call-parser`, ember_cupy/tool_parsers.py; default: Hermes-style
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks: Qwen, Hermes, SmolLM3);
`required` and named functions are constrained as above.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass

from ember_cupy.structured.closed_objects import close_objects
from ember_cupy.structured.compiler import JSON_LAYOUT
from ember_cupy.structured.params import StructuredOutputsParams
from ember_cupy.tool_parsers import PARSERS, ToolParser

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
DEFAULT_PARSER = PARSERS["hermes"]
# plain text in `auto`: anything not starting like a call array (or white space before one)
_TEXT_LEXEME = r"/[^\[\s][\s\S]*/"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                   # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        if not self.id:
            object.__setattr__(self, "id", "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and tool_choice, validated: mode is none | auto | required | named."""
    tools: tuple[Tool, ...]
    mode: str
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none" and bool(self.tools)


NO_TOOLS = ToolSpec((), "none")


# --- the request side ----------------------------------------------------------------------------
def parse_tools(tools, tool_choice=None, parallel_tool_calls: bool | None = True) -> ToolSpec:
    """OpenAI's `tools` (list of {"type": "function", "function": {...}}) and `tool_choice`;
    ValueError naming the field at fault."""
    parsed = tuple(_parse_tool(t, i) for i, t in enumerate(tools or []))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: function names must be unique, got {names}")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if not isinstance(parallel, bool):
        raise ValueError("parallel_tool_calls must be a boolean")
    if tool_choice is None:
        return ToolSpec(parsed, "auto" if parsed else "none", parallel=parallel)
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not parsed:
            raise ValueError(f"tool_choice {tool_choice!r} needs a non-empty 'tools' list")
        return ToolSpec(parsed, tool_choice, parallel=parallel)
    name = _named_choice(tool_choice)
    if name not in names:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools ({names})")
    return ToolSpec(parsed, "named", named=name, parallel=parallel)


def _parse_tool(tool, index: int) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
            or not isinstance(tool.get("function"), dict):
        raise ValueError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ValueError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise ValueError(f"{where}.function.parameters must be a JSON schema object")
    return Tool(name, description, parameters)


def _named_choice(tool_choice) -> str:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) \
            and isinstance(tool_choice["function"].get("name"), str):
        return tool_choice["function"]["name"]
    raise ValueError('tool_choice must be "none", "auto", "required" or '
                     '{"type": "function", "function": {"name": ...}}')


def calls_schema(spec: ToolSpec) -> dict:
    """The JSON schema of a call array: one item per call, the arguments per the tool."""
    items = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for t in spec.tools]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not spec.parallel:
        schema["maxItems"] = 1
    return schema


def output_constraint(spec: ToolSpec, template_supports_tools: bool) -> StructuredOutputsParams | None:
    """What the output is held to (see the module docstring); None = free text."""
    if not spec.active:
        return None
    if spec.mode == "named":
        return StructuredOutputsParams(json=_tool(spec, spec.named).parameters)
    if spec.mode == "required":
        return StructuredOutputsParams(json=calls_schema(spec))
    if template_supports_tools:
        return None
    schema = json.dumps({**close_objects(calls_schema(spec)), "x-guidance": JSON_LAYOUT}, ensure_ascii=False)
    return StructuredOutputsParams(grammar=f"start: calls | text\ncalls: %json {schema}\ntext: {_TEXT_LEXEME}\n")


def constrain(params, spec: ToolSpec, template_supports_tools: bool):
    """params (SamplingParams) with the tool calls' output constraint, if they have one."""
    constraint = output_constraint(spec, template_supports_tools)
    if constraint is None:
        return params
    if params.structured_outputs is not None:
        raise ValueError(f"tool_choice {spec.mode!r} constrains the output already: it cannot be combined "
                         "with structured_outputs or a JSON response_format")
    return dataclasses.replace(params, structured_outputs=constraint)


def _tool(spec: ToolSpec, name: str) -> Tool:
    return next(t for t in spec.tools if t.name == name)


# --- the prompt ----------------------------------------------------------------------------------
def system_prompt(spec: ToolSpec) -> str:
    """The generic format's description of the tools and of the reply."""
    described = json.dumps([{"name": t.name, "description": t.description, "parameters": t.parameters}
                            for t in spec.tools], ensure_ascii=False)
    example = '[{"name": "<function name>", "arguments": {<its arguments>}}]'
    if spec.mode == "named":
        how = f"Call the function {spec.named}: reply with only its arguments as one JSON object."
    elif spec.mode == "required":
        how = f"Call one or more of them: reply with only a JSON array of calls, like {example}"
    else:
        how = (f"When the user's request needs a function, reply with only a JSON array of calls, "
               f"like {example}. Otherwise reply in plain text.")
    return f"You can call these functions:\n{described}\n{how}"


def prepare_messages(messages: list[dict], spec: ToolSpec, template_supports_tools: bool) -> list[dict]:
    """The messages the chat template renders: in the generic format, the tool description in the
    system message and assistant tool calls as their call array."""
    if template_supports_tools:
        return messages
    out = [_generic_message(m) for m in messages]
    if not spec.active:
        return out
    prompt = system_prompt(spec)
    if out and out[0].get("role") == "system":
        content = _as_text(out[0].get("content"))
        return [{**out[0], "content": f"{content}\n\n{prompt}" if content else prompt}] + out[1:]
    return [{"role": "system", "content": prompt}] + out


def _generic_message(message: dict) -> dict:
    if not isinstance(message, dict) or message.get("role") != "assistant" or not message.get("tool_calls"):
        return message
    calls = []
    for index, call in enumerate(message["tool_calls"]):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"tool_calls[{index}] must be {{\"type\": \"function\", \"function\": "
                             "{\"name\": ..., \"arguments\": ...}}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass   # shown as the string it is
        calls.append({"name": function["name"], "arguments": arguments})
    text = _as_text(message.get("content"))
    rendered = json.dumps(calls, ensure_ascii=False)
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": f"{text}\n{rendered}" if text else rendered}


def _as_text(content) -> str:
    """Message content as text: OpenAI allows a string or a list of {"type": "text"} parts."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


# --- the output side -----------------------------------------------------------------------------
def parse_output(text: str, spec: ToolSpec, template_supports_tools: bool = False,
                 parser: ToolParser | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output. Text that is not a valid call stays content."""
    if not spec.active:
        return text, []
    if spec.mode == "named":
        arguments = _json_or_none(text)
        if not isinstance(arguments, dict):
            return text, []
        return None, [ToolCall(spec.named, json.dumps(arguments, ensure_ascii=False))]
    if template_supports_tools and spec.mode == "auto":
        content, calls = (parser or DEFAULT_PARSER).parse(text, {t.name for t in spec.tools})
        return (content.strip() or None if calls and content else content), \
            [ToolCall(c.name, json.dumps(c.arguments, ensure_ascii=False)) for c in calls]
    calls = _calls_from_array(_json_or_none(text.strip()) if text.lstrip().startswith("[") else None, spec)
    return (None, calls) if calls else (text, [])


def _calls_from_array(value, spec: ToolSpec) -> list[ToolCall]:
    names = {t.name for t in spec.tools}
    if not isinstance(value, list) or not value:
        return []
    calls = []
    for item in value:
        if not (isinstance(item, dict) and item.get("name") in names and isinstance(item.get("arguments"), dict)):
            return []
        calls.append(ToolCall(item["name"], json.dumps(item["arguments"], ensure_ascii=False)))
    return calls


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return None


class ToolCallStream:
    """Streaming: which text deltas are content and which are a tool call in the making.

    A call is sent whole (id, name, arguments) once its output finishes: the arguments are only
    known to be valid then. Content streams as it comes: in the generic `auto` format the first
    character decides (a call array starts with "[", text never does); with a family's parser,
    content runs until its calls start (text that may be the start of a marker waits a delta).
    """

    def __init__(self, spec: ToolSpec, template_supports_tools: bool = False, parser: ToolParser | None = None):
        self.spec = spec
        self.template_supports_tools = template_supports_tools
        self.parser = (parser or DEFAULT_PARSER) if template_supports_tools and spec.mode == "auto" else None
        self._text = ""
        self._sent = 0                      # characters of _text sent as content
        self._holding = spec.mode in ("named", "required")

    def feed(self, delta_text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """(content to send now, tool calls to send now)."""
        self._text += delta_text
        if not self.spec.active:
            return delta_text, []
        if self.parser is not None:
            return self._feed_family(finished)
        if not self._holding and self._text.startswith("["):
            self._holding = True
        if not self._holding:
            return delta_text, []
        if not finished:
            return "", []
        content, calls = parse_output(self._text, self.spec, self.template_supports_tools)
        return content or "", calls

    def _feed_family(self, finished: bool) -> tuple[str, list[ToolCall]]:
        if finished:
            content, calls = parse_output(self._text, self.spec, True, self.parser)
            return self._send(len(self._text) if not calls else self._sent), calls
        start = self.parser.call_start(self._text)
        if start is not None:
            return self._send(start), []
        return self._send(len(self._text) - self.parser.holdback(self._text)), []

    def _send(self, upto: int) -> str:
        upto = max(upto, self._sent)
        text, self._sent = self._text[self._sent:upto], upto
        return text


def render_chat(tokenizer, messages: list[dict], spec: ToolSpec, add_generation_prompt: bool = True,
                **template_kwargs):
    """The chat prompt for messages with spec's tools (see the module docstring)."""
    supports = template_supports_tools(tokenizer)
    messages = prepare_messages(messages, spec, supports)
    if supports and spec.active:
        template_kwargs["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters}} for t in spec.tools]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **template_kwargs)


def template_supports_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return bool(template is not None and template.supports_tools)


# --- OpenAI response shapes ------------------------------------------------------------------------
def set_full_choice(choice: dict, text: str, spec: ToolSpec, template_supports_tools: bool,
                    parser: ToolParser | None = None) -> None:
    """A chat choice ({"message": ..., "finish_reason": ...}) with its tool calls, if it made any."""
    content, calls = parse_output(text, spec, template_supports_tools, parser)
    if calls:
        choice["message"]["content"] = content
        choice["message"]["tool_calls"] = [c.to_openai() for c in calls]
        choice["finish_reason"] = "tool_calls"


def stream_delta(stream: ToolCallStream, delta_text: str, finished: bool) -> tuple[dict, bool]:
    """(the chunk's delta, whether it carries tool calls: its finish_reason is then "tool_calls")."""
    content, calls = stream.feed(delta_text, finished)
    delta = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [{"index": i, **c.to_openai()} for i, c in enumerate(calls)]
    return delta, bool(calls)
