"""What a request constrains its output to: a JSON schema, any JSON object, a regex, a choice of
strings or a grammar (Lark, or GBNF which llguidance converts). vLLM's `StructuredOutputsParams`.

A JSON schema is read in strict mode unless `disable_additional_properties` is False: an object
that lists `properties` without `additionalProperties` allows no other key (closed_objects.py).
vLLM has the same field, whose default there is False (its guidance backend reads plain JSON
Schema); here it is True, as OpenAI's strict mode and vLLM's xgrammar backend read schemas.

Only the shape is checked here; whether the schema, regex or grammar itself is valid is decided
by the compiler (ember_cupy/structured/compiler.py), which needs the tokenizer and may be slow, so
the server runs it off its event loop.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ember_cupy.checks import require


KINDS = ("json", "json_object", "regex", "choice", "grammar")
OPTIONS = ("disable_additional_properties",)
MAX_SPEC_CHARS = 1 << 20   # a schema, regex or grammar larger than 1 MiB of text is refused
ANY_OBJECT_SCHEMA = {"type": "object"}


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | bool | None = None      # a JSON schema (object, JSON text, or a boolean schema)
    json_object: bool = False                   # any JSON object ({"type": "json_object"})
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None                  # Lark (llguidance's dialect) or GBNF
    disable_additional_properties: bool = True  # json: absent additionalProperties means false

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        require(len(given) == 1, "structured_outputs must set exactly one of "
                f"{', '.join(KINDS)}; got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        if self.regex is not None:
            require(isinstance(self.regex, str) and self.regex != "",
                    "structured_outputs.regex must be a non-empty string")
        if self.grammar is not None:
            require(isinstance(self.grammar, str) and self.grammar.strip() != "",
                    "structured_outputs.grammar must be a non-empty string")
        if self.choice is not None:
            choice = self.choice
            require(isinstance(choice, (list, tuple)) and len(choice) > 0
                    and all(isinstance(c, str) and c for c in choice),
                    "structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(choice))
        require(self.json_object in (True, False), "structured_outputs.json_object must be a boolean")
        require(self.disable_additional_properties in (True, False),
                "structured_outputs.disable_additional_properties must be a boolean")
        require(len(self.spec) <= MAX_SPEC_CHARS,
                f"structured_outputs.{self.kind} is longer than {MAX_SPEC_CHARS} characters")

    @classmethod
    def from_value(cls, value) -> "StructuredOutputsParams | None":
        """None, an instance, or a dict of its fields (as in a request body)."""
        if value is None or isinstance(value, cls):
            return value
        require(isinstance(value, dict), "structured_outputs must be an object with one of "
                f"{', '.join(KINDS)}")
        unknown = sorted(set(value) - set(KINDS) - set(OPTIONS))
        require(not unknown, "structured_outputs has unknown field(s) "
                f"{unknown}; allowed: {', '.join(KINDS + OPTIONS)}")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text (as the client wrote it)."""
        kind = self.kind
        if kind == "json":
            return json.dumps(self.json, separators=(",", ":"), ensure_ascii=False)
        if kind == "json_object":
            return json.dumps(ANY_OBJECT_SCHEMA)
        if kind == "choice":
            return json.dumps(list(self.choice), ensure_ascii=False)
        return getattr(self, kind)

    @property
    def closes_objects(self) -> bool:
        """Whether the JSON schema is read in strict mode (see the module docstring)."""
        return self.kind == "json" and self.disable_additional_properties

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on: the key of the compiled-grammar cache."""
        return self.kind, self.spec, self.closes_objects


def _schema(value) -> dict | bool:
    """A JSON schema given as a dict, a boolean or JSON text -> dict or bool."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    require(isinstance(value, (dict, bool)),
            "structured_outputs.json must be a JSON schema (an object or a boolean)")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.json is not serialisable as JSON: {exc}") from None
    return value
