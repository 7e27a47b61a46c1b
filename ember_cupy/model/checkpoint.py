"""What a loader hands to the engine: the model's shape, its weights, its tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ember_cupy.config import ModelConfig
from ember_cupy.quant import QuantizedStack, QuantizedTensor

# Canonical weight names, independent of the file format:
#   embed, norm, lm_head (absent when tied),
#   layers.{i}.{attn_norm, qkv, qkv_bias (optional), o, ffn_norm, gate_up, down}
# Float linear weights are stored transposed, [in_features, out_features], so a layer is `x @ W`
# (on CPU BLAS ~20% faster than `x @ W.T` for small batches); GGUF-quantized ones stay
# `QuantizedTensor` [out_features, in_features] in their file blocks (ember_cupy/quant.py).
# q/k are in HF order (rotate-half RoPE). q/k/v and gate/up are fused at load (one matmul each):
# quantized parts as a `QuantizedStack` of them, stacked when they are put in serving format
# (packed part by part into one matrix per run of one format, model/weights.py), so the file's
# blocks are never copied whole first; float parts into one matrix.

ProgressCallback = Callable[[int, int], None]  # (done, total)


def check_weight_shapes(weights: dict, config: ModelConfig, source: str) -> None:
    """Every weight as the model's configuration shapes it ([out, in] for a matrix, before
    prepare_linear_weights): a mismatch names the tensor, rather than failing later in a
    concatenation or a matmul. The vocabulary dimension is not checked (files pad it)."""
    hidden, head_dim, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * head_dim, config.num_kv_heads * head_dim
    expected = {"norm": (hidden,), "attn_norm": (hidden,), "ffn_norm": (hidden,), "post_attn_norm": (hidden,),
                "post_ffn_norm": (hidden,), "q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden),
                "o": (hidden, q), "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,), "q_norm": (head_dim,),
                "k_norm": (head_dim,), "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    for name, weight in weights.items():
        kind, shape = name.rsplit(".", 1)[-1], tuple(int(d) for d in weight.shape)
        if kind in ("embed", "lm_head"):
            if len(shape) != 2 or shape[1] != hidden:
                raise ValueError(f"{source}: tensor {name} has shape {shape}; the model's configuration "
                                 f"asks for (vocabulary, {hidden})")
        elif kind in expected and shape != expected[kind]:
            raise ValueError(f"{source}: tensor {name} has shape {shape}; the model's configuration asks for "
                             f"{expected[kind]}")


def prepare_linear_weights(weights: dict[str, np.ndarray], num_layers: int) -> None:
    """In place: layers.i.{q,k,v} -> qkv (+ qkv_bias), layers.i.{gate,up} -> gate_up, and every
    layer's linear weight [out, in] -> its transpose [in, out]."""
    for i in range(num_layers):
        pop = lambda name: weights.pop(f"layers.{i}.{name}", None)  # noqa: E731
        parts = [pop(n) for n in ("q", "k", "v")]
        if any(p is None for p in parts):
            raise ValueError(f"layer {i}: q/k/v projection missing from the checkpoint")
        weights[f"layers.{i}.qkv"] = _fused(parts)
        biases = [pop(f"{n}_bias") for n in ("q", "k", "v")]
        if any(b is not None for b in biases):
            weights[f"layers.{i}.qkv_bias"] = np.concatenate([
                b if b is not None else np.zeros(_rows(w), np.float32) for b, w in zip(biases, parts)])
        gate, up = pop("gate"), pop("up")
        if gate is None or up is None:
            raise ValueError(f"layer {i}: gate/up projection missing from the checkpoint")
        weights[f"layers.{i}.gate_up"] = _fused([gate, up])
        for name in ("o", "down"):
            weights[f"layers.{i}.{name}"] = _fused([weights[f"layers.{i}.{name}"]])


def _rows(weight) -> int:
    return weight.shape[0]


def _fused(parts: list) -> np.ndarray | QuantizedTensor | QuantizedStack:
    """[out, in] parts -> one weight: quantized parts as they are (one, or a QuantizedStack of
    them), or else (float parts) a float [in, out] matrix."""
    if all(isinstance(p, QuantizedTensor) for p in parts):
        return parts[0] if len(parts) == 1 else QuantizedStack(tuple(parts))
    floats = [p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts]
    return np.ascontiguousarray((floats[0] if len(floats) == 1 else np.concatenate(floats)).T)


@dataclass(frozen=True)
class ModelFacts:
    """What a model file is, read from its headers alone (no weights)."""
    architecture: str
    file_type: str        # GGUF's general.file_type by name (Q4_K_M, Q8_0...); a checkpoint's dtype (BF16...)
    num_parameters: int   # the elements of every tensor of the file(s)


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, np.ndarray | QuantizedTensor]
    tokenizer: "object"           # ember_cupy.tokenizer.Tokenizer
    source: str
    stored_dtype: str | None = None   # the file's float dtype (HF: float32/float16/bfloat16; GGUF: None)
    facts: ModelFacts | None = None   # what the file holds (read at load; None for one built in memory)

    def take(self, name: str):
        """require(name), removing it from the checkpoint (the caller now holds the only copy)."""
        tensor = self.require(name)
        del self.weights[name]
        return tensor

    def require(self, name: str):
        try:
            return self.weights[name]
        except KeyError:
            raise ValueError(f"checkpoint {self.source} has no tensor for {name!r}") from None
