"""JSON schemas read in strict mode: an object schema that lists `properties` and says nothing of
`additionalProperties` gets `additionalProperties: false`, as OpenAI's strict mode and vLLM's
xgrammar backend read it (under plain JSON Schema, absent means any other key is allowed, and a
small model then adds keys until max_tokens). An object schema without `properties` stays open
(it says nothing of its keys: `{"type": "object"}` is any object), and so do the branches of an
`allOf` (closing each would refuse the keys the other branches add).
"""
from __future__ import annotations

import copy

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "propertyNames", "additionalItems", "unevaluatedItems", "unevaluatedProperties")


def close_objects(schema):
    """A copy of schema (a dict or a boolean) with its listed-property objects closed."""
    schema = copy.deepcopy(schema)
    pending = [(schema, True)]      # (subschema, whether it may be closed); iterative: no depth limit
    while pending:
        node, closable = pending.pop()
        if not isinstance(node, dict):
            continue
        if closable and isinstance(node.get("properties"), dict) and "additionalProperties" not in node \
                and "unevaluatedProperties" not in node:
            node["additionalProperties"] = False
        pending.extend(_subschemas(node))
    return schema


def _subschemas(node: dict):
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from ((value, True) for value in node[key].values())
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from ((value, True) for value in node[key])
    if isinstance(node.get("allOf"), list):
        yield from ((value, False) for value in node["allOf"])
    for key in _SCHEMA_VALUES:
        value = node.get(key)
        if isinstance(value, list):   # the old tuple form of items
            yield from ((item, True) for item in value)
        elif isinstance(value, dict):
            yield value, True
