"""What Ollama's model routes say of the served model: /api/tags, /api/ps and /api/show bodies,
built from the engine's ModelInfo and the model file's place on disk."""
from __future__ import annotations

import hashlib

from ember_cupy.engine_client import ModelInfo
from ember_cupy.server.model_pool import weight_files
from ember_cupy.server.ollama_replies import now_rfc3339
from ember_cupy.server.ollama_requests import LATEST

NEVER = "9999-12-31T23:59:59Z"


def listed_name(name: str) -> str:
    """A served name as Ollama lists it: with a tag (":latest" unless it has one)."""
    return name if ":" in name else name + LATEST


def parameter_size(count: int) -> str:
    """Ollama's way of writing a parameter count: 134.52M, 1.2B, 7B."""
    for scale, unit, decimals in ((1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 2)):
        if count >= scale:
            text = f"{count / scale:.{decimals}f}".rstrip("0").rstrip(".")
            return text + unit
    return str(count)


def details(source: str, facts) -> dict:
    """facts: a ModelInfo, or a model file's facts (ember_cupy.model.checkpoint.ModelFacts)."""
    family = facts.architecture
    return {"parent_model": "", "format": "gguf" if source.endswith(".gguf") else "safetensors",
            "family": family, "families": [family], "parameter_size": parameter_size(facts.num_parameters),
            "quantization_level": facts.file_type}


class ServedFile:
    """The model's weight files on disk: their size, modification time and an identifying digest."""

    def __init__(self, source: str):
        stats = [(path, path.stat()) for path in weight_files(source)]
        self.size = sum(st.st_size for _, st in stats)
        self.modified = max((st.st_mtime for _, st in stats), default=0.0)
        identity = "\0".join(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}" for p, st in stats)
        self.digest = hashlib.sha256(identity.encode()).hexdigest()


def tags_entry(name: str, source: str, facts, served: ServedFile) -> dict:
    listed = listed_name(name)
    return {"name": listed, "model": listed, "modified_at": now_rfc3339(served.modified), "size": served.size,
            "digest": served.digest, "details": details(source, facts)}


def running_entry(name: str, info: ModelInfo, served: ServedFile) -> dict:
    listed = listed_name(name)
    on_gpu = info.runtime.get("backend") not in (None, "numpy")
    return {"name": listed, "model": listed, "size": info.weight_bytes, "digest": served.digest,
            "details": details(info.source, info), "expires_at": NEVER, "size_vram": info.weight_bytes if on_gpu else 0,
            "context_length": info.max_model_len}


def show_body(info: ModelInfo, served: ServedFile, template: str, capabilities: list[str]) -> dict:
    arch = info.architecture
    return {"modelfile": "", "parameters": "", "template": template, "details": details(info.source, info),
            "model_info": {"general.architecture": arch, "general.parameter_count": info.num_parameters,
                           f"{arch}.context_length": info.max_model_len,
                           f"{arch}.embedding_length": info.hidden_size,
                           f"{arch}.vocab_size": info.vocab_size},
            "capabilities": capabilities, "modified_at": now_rfc3339(served.modified)}
