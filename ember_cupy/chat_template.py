"""The model's own chat template, rendered with jinja2 the way transformers does."""
from __future__ import annotations

import datetime
import json
import os

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool", "developer")


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _text_content(content, index: int) -> str:
    """OpenAI allows content as a string or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts")


def normalize_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{index}].role must be one of {ROLES}, got {role!r}")
        content = message.get("content")
        if content is None and role != "assistant":
            raise ValueError(f"messages[{index}].content is required")
        normalized.append({**message, "content": _text_content(content or "", index)})
    return normalized


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    """transformers' tojson: json.dumps with the template's own formatting arguments."""
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self.source = source   # as written: /tokenizer_info hands it to remote tokenizers
        # a template that reads `tools` renders them (and its own tool-call format) itself;
        # the others get ember_cupy/tool_calls.py's generic format
        self.supports_tools = "tools" in source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        messages = normalize_messages(messages)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from None


def read_chat_template(value: str) -> str:
    """vLLM's --chat-template: a file's path, or the Jinja source itself. A value with no Jinja in
    it that names no file is a ValueError, and so is a template that does not parse."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            source = f.read()
    elif "{" in value:
        source = value
    else:
        raise ValueError(f"chat template {value!r}: no such file, and not a Jinja template")
    try:
        ImmutableSandboxedEnvironment().parse(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"chat template: {exc} (line {exc.lineno})") from None
    return source
