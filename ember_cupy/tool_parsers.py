"""Tool-call parsers (`--tool-call-parser`, vLLM's names): the calls a model family writes in free
text, for `tool_choice: "auto"` on a chat template that renders the tools itself.

  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...   (Hermes, Qwen2.5, SmolLM3)
  llama3_json  {"name": ..., "parameters": {...}}; ...  or after <|python_tag|>   (Llama 3.1-3.3)
  mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]             (Mistral v3-v7 tokenizers)
               [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]...                       (v11+)
  pythonic     [get_weather(city="Paris"), other(x=1)]                           (Llama 3.2 / 4)
  qwen3_xml    <tool_call><function=name><parameter=key>value</parameter>...</function></tool_call>
                                                                                  (Qwen3-Coder)

A reply is content up to where its calls start (`call_start`), then calls to its end. A reply
whose calls do not parse, or name a function not offered, is all content: nothing half-parsed
reaches the client.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict


class ToolParser:
    """A family's call format: `anywhere` markers open the calls wherever they appear, `leading`
    ones only as the reply's first non-blank text."""
    name = ""
    anywhere: tuple[str, ...] = ()
    leading: tuple[str, ...] = ()

    def call_start(self, text: str) -> int | None:
        """Where the calls begin in `text`, or None (no marker in it yet)."""
        found = [i for i in (text.find(m) for m in self.anywhere) if i >= 0]
        stripped = text.lstrip()
        if any(stripped.startswith(m) for m in self.leading):
            found.append(len(text) - len(stripped))
        return min(found) if found else None

    def holdback(self, text: str) -> int:
        """How many of text's last characters a stream holds back, as they could still grow into a
        marker: all of a reply that is blank or the start of a leading one so far."""
        stripped = text.lstrip()
        if any(m.startswith(stripped) for m in self.leading) or (self.leading and not stripped):
            return len(text)
        return max((k for m in self.anywhere for k in range(1, len(m)) if text.endswith(m[:k])), default=0)

    def calls(self, text: str) -> list[ParsedCall] | None:
        """The calls in text (from call_start on); None when they do not parse."""
        raise NotImplementedError

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a whole reply."""
        start = self.call_start(text)
        if start is None:
            return text, []
        calls = self.calls(text[start:])
        if not calls or any(c.name not in names or not isinstance(c.arguments, dict) for c in calls):
            return text, []
        content = text[:start]
        return (content if content.strip() else None), calls


def _json(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return None


def _call(item, arguments_key: str = "arguments") -> ParsedCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get(arguments_key, item.get("arguments", {}))
    if isinstance(arguments, str):
        arguments = _json(arguments)
    return ParsedCall(item["name"], arguments) if isinstance(arguments, dict) else None


def _all(calls: list) -> list[ParsedCall] | None:
    return calls if calls and all(c is not None for c in calls) else None


class HermesParser(ToolParser):
    name = "hermes"
    anywhere = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def calls(self, text):
        return _all([_call(_json(b)) for b in self._block.findall(text)])


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    anywhere = ("<|python_tag|>",)
    leading = ("{",)

    def calls(self, text):
        text = text.replace("<|python_tag|>", "").strip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(text):
            try:
                item, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return None
            calls.append(_call(item, "parameters"))
            at = len(text) - len(text[at:].lstrip().removeprefix(";").lstrip())
        return _all(calls)


class MistralParser(ToolParser):
    name = "mistral"
    anywhere = ("[TOOL_CALLS]",)
    leading = ('[{"name"',)

    def calls(self, text):
        parts = [p.strip() for p in text.split("[TOOL_CALLS]") if p.strip()]
        if len(parts) == 1 and parts[0].startswith("["):          # v3-v7: one JSON array
            array = _json(parts[0])
            return _all([_call(i) for i in array]) if isinstance(array, list) else None
        calls = []
        for part in parts:                                         # v11+: name[ARGS]{...}
            name, sep, arguments = part.partition("[ARGS]")
            calls.append(ParsedCall(name.strip(), _json(arguments)) if sep else None)
        return _all(calls)


class PythonicParser(ToolParser):
    name = "pythonic"
    anywhere = ("<|python_start|>",)
    leading = ("[",)

    def calls(self, text):
        text = text.replace("<|python_start|>", "").replace("<|python_end|>", "").strip()
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List):
            return None
        return _all([self._call(node) for node in tree.elts])

    @staticmethod
    def _call(node) -> ParsedCall | None:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
            return None
        try:
            return ParsedCall(node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords})
        except (ValueError, TypeError, SyntaxError):
            return None


class Qwen3XmlParser(ToolParser):
    name = "qwen3_xml"
    anywhere = ("<tool_call>", "<function=")
    _function = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def calls(self, text):
        return _all([ParsedCall(name, {k: self._value(v) for k, v in self._parameter.findall(body)})
                     for name, body in self._function.findall(text)])

    @staticmethod
    def _value(text: str):
        """A parameter's value: JSON where it reads as JSON (numbers, booleans, objects), else text."""
        value = _json(text)
        return text if value is None and text.strip() != "null" else value


PARSERS = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(), PythonicParser(),
                               Qwen3XmlParser())}


def get_parser(name: str | None) -> ToolParser | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]
