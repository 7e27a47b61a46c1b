"""What a loader hands to the engine: the model's shape, its float32 weights, its tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ember_cupy.config import ModelConfig

# Canonical weight names, independent of the file format:
#   embed, norm, lm_head (absent when tied),
#   layers.{i}.{attn_norm, qkv, qkv_bias (optional), o, ffn_norm, gate_up, down}
# Linear weights are stored transposed, [in_features, out_features], so a layer is `x @ W`
# (on CPU BLAS ~20% faster than `x @ W.T` for small batches); q/k columns are in HF order
# (rotate-half RoPE). q/k/v and gate/up are fused at load (one GEMM each), and the parts are
# dropped so the weights are held once.

ProgressCallback = Callable[[int, int], None]  # (done, total)


def prepare_linear_weights(weights: dict[str, np.ndarray], num_layers: int) -> None:
    """In place: layers.i.{q,k,v} -> qkv (+ qkv_bias), layers.i.{gate,up} -> gate_up, and every
    layer's linear weight [out, in] -> its transpose [in, out]."""
    for i in range(num_layers):
        pop = lambda name: weights.pop(f"layers.{i}.{name}", None)  # noqa: E731
        parts = [pop(n) for n in ("q", "k", "v")]
        if any(p is None for p in parts):
            raise ValueError(f"layer {i}: q/k/v projection missing from the checkpoint")
        weights[f"layers.{i}.qkv"] = _transposed(np.concatenate(parts))
        biases = [pop(f"{n}_bias") for n in ("q", "k", "v")]
        if any(b is not None for b in biases):
            weights[f"layers.{i}.qkv_bias"] = np.concatenate([
                b if b is not None else np.zeros(len(w), np.float32) for b, w in zip(biases, parts)])
        gate, up = pop("gate"), pop("up")
        if gate is None or up is None:
            raise ValueError(f"layer {i}: gate/up projection missing from the checkpoint")
        weights[f"layers.{i}.gate_up"] = _transposed(np.concatenate([gate, up]))
        for name in ("o", "down"):
            weights[f"layers.{i}.{name}"] = _transposed(weights[f"layers.{i}.{name}"])


def _transposed(weight: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(weight.T)


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
