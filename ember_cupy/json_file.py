"""A model folder's JSON files (config.json, tokenizer_config.json, ...), read with an error that
names the file."""
from __future__ import annotations

import json


def read_json_object(file: str) -> dict:
    """The JSON object in `file`; ValueError naming the file when it holds anything else."""
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file}: not a JSON object")
    return value
