"""What a loader hands to the engine: the model's shape, its float32 weights, its tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ember_cupy.config import ModelConfig

# Canonical weight names, independent of the file format:
#   embed, norm, lm_head (absent when tied),
#   layers.{i}.{attn_norm, q, k, v, o, q_bias, k_bias, v_bias, ffn_norm, gate, up, down}
# Linear weights are [out_features, in_features]; q/k rows are in HF order (rotate-half RoPE).

ProgressCallback = Callable[[int, int], None]  # (done, total)


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: "object"           # ember_cupy.tokenizer.Tokenizer
    source: str

    def require(self, name: str) -> np.ndarray:
        try:
            return self.weights[name]
        except KeyError:
            raise ValueError(f"checkpoint {self.source} has no tensor for {name!r}") from None
