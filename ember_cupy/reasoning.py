"""Reasoning parsers (`--reasoning-parser`, vLLM's names): the part of a reply a model thinks in,
`<think> ... </think>`, split from the answer, whole or delta by delta.

- `deepseek_r1`: the DeepSeek-R1 distills' templates open `<think>` in the prompt, so a reply is
  reasoning until `</think>` (a leading `<think>` the model writes anyway is dropped); a reply that
  never closes it is all reasoning (cut off while thinking), as vLLM reads it.
- `qwen3`: Qwen3 thinks when its reply starts with `<think>`, or when the prompt ends with one
  (Qwen3-2507 thinking templates, `enable_thinking`); otherwise (`enable_thinking=False`, an
  instruct model) the reply is all answer.

A streamed reply is split as the whole one would be: a delta's text that could still be the start
of the tag being looked for is held back until the next delta decides it.
"""
from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def check_parser(name: str | None) -> str | None:
    if name is not None and name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not one of {', '.join(PARSERS)}")
    return name


def prompt_opens_thinking(prompt: str) -> bool:
    return prompt.rstrip().endswith(THINK_START)


@dataclass
class ReasoningSplit:
    reasoning: str | None
    content: str | None


class ReasoningStream:
    """Feed a reply's text deltas; each feed returns the (reasoning, content) text known by now."""

    def __init__(self, parser: str, prompt: str = ""):
        check_parser(parser)
        self._state = "thinking" if parser == "deepseek_r1" or prompt_opens_thinking(prompt) else "undecided"
        self._drop_start = True       # a leading <think> inside a reply that is thinking already
        self._held = ""

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        self._held += delta
        reasoning, content = "", ""
        while True:
            if self._state == "undecided":
                stripped = self._held.lstrip()
                if stripped.startswith(THINK_START):
                    self._held = stripped[len(THINK_START):]
                    self._state, self._drop_start = "thinking", False
                elif THINK_START.startswith(stripped) and not finished:
                    return reasoning, content           # could still become "<think>"
                else:
                    self._state = "answering"
                continue
            if self._state == "thinking":
                if self._drop_start:
                    stripped = self._held.lstrip()
                    if THINK_START.startswith(stripped) and stripped != THINK_START and not finished:
                        return reasoning, content
                    if stripped.startswith(THINK_START):
                        self._held = stripped[len(THINK_START):]
                    self._drop_start = False
                end = self._held.find(THINK_END)
                if end >= 0:
                    reasoning += self._held[:end]
                    self._held = self._held[end + len(THINK_END):]
                    self._state = "answering"
                    continue
                keep = 0 if finished else _partial_suffix(self._held, THINK_END)
                reasoning += self._held[:len(self._held) - keep]
                self._held = self._held[len(self._held) - keep:]
                return reasoning, content
            content += self._held
            self._held = ""
            return reasoning, content


def split_reasoning(parser: str, text: str, prompt: str = "") -> ReasoningSplit:
    """A whole reply's (reasoning, content); None where a part is empty."""
    reasoning, content = ReasoningStream(parser, prompt).feed(text, finished=True)
    return ReasoningSplit(reasoning or None, content or None)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
