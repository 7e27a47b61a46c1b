"""A model's default sampling parameters, as vLLM's --generation-config reads them: `auto` takes
generation_config.json of a Hugging Face directory (a GGUF file has none), `vllm` none, another value
is a directory holding one; --override-generation-config's JSON goes on top. A request (or the
Python API's call without SamplingParams) gets a default for each field it leaves out."""
from __future__ import annotations

import os

from ember_cupy.json_file import read_json_object

# generation_config.json's names -> SamplingParams' (vLLM reads the same ones)
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_path: str, source: str = "auto", overrides: dict | None = None) -> dict:
    """SamplingParams field -> default value."""
    found = {} if source == "vllm" else _read(model_path if source == "auto" else source, source != "auto")
    defaults = {FIELDS[k]: v for k, v in found.items() if k in FIELDS and v is not None}
    for key, value in (overrides or {}).items():
        if key not in FIELDS:
            raise ValueError(f"override generation config: unknown field {key!r}; known: {sorted(FIELDS)}")
        defaults[FIELDS[key]] = value
    return defaults


def _read(directory: str, required: bool) -> dict:
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        if required:
            raise ValueError(f"generation config: {path} does not exist")
        return {}
    try:
        return read_json_object(path)
    except OSError as exc:
        raise ValueError(f"generation config {path}: {exc}") from None
