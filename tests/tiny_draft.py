"""A tiny random draft model for the default one: a GGUF of two small layers with SmolLM2's own
vocabulary (its tokenizer fields copied), so its tokens mean the target's but it drafts poorly."""
from __future__ import annotations

import json

import numpy as np
from tiny_gguf import write_tiny_gguf
from tiny_model import write_tiny_checkpoint

from ember_cupy.model.loader import default_model_path


def write_tiny_draft(folder, vocab_size: int, seed: int = 0, renamed_tokens: dict[int, str] | None = None) -> str:
    """folder: a fresh pathlib directory; vocab_size: the default model's; renamed_tokens: {id: text}
    changed in the copied vocabulary. Returns the GGUF's path."""
    weights = write_tiny_checkpoint(folder / "hf", seed=seed)
    config = json.loads((folder / "hf" / "config.json").read_text())
    hidden = config["hidden_size"]
    rng = np.random.default_rng(seed)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = (rng.standard_normal((vocab_size, hidden)) / np.sqrt(hidden)).astype(np.float32)
    config.update(vocab_size=vocab_size, max_position_embeddings=8192)
    return write_tiny_gguf(folder / "draft.gguf", weights, config, tokenizer_from=default_model_path(),
                           renamed_tokens=renamed_tokens)
