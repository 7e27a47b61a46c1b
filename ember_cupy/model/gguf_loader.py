"""GGUF checkpoints (llama.cpp's format) through the `gguf` package.

F32 tensors (and 16-bit vectors) are read as float32; quantized matrices stay in their GGUF
blocks as `QuantizedTensor`s, F16/BF16 matrices in their 16 bits as QuantizedTensors of qtype
F16/BF16 (the model decides their serving format: ember_cupy/model/weights.py).
"""
from __future__ import annotations

import re

import numpy as np

from ember_cupy.config import ModelConfig
from ember_cupy.gguf_file import GGUFFile, release_pages
from ember_cupy.gguf_metadata import field_value
from ember_cupy.model.checkpoint import (
    Checkpoint,
    ModelFacts,
    ProgressCallback,
    check_weight_shapes,
    prepare_linear_weights,
)
from ember_cupy.quant import QuantizedTensor, half_tensor

# llama.cpp's converter writes Mistral (and Llama 2/3, TinyLlama, SmolLM) as "llama".
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

_GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head",
                 "rope_freqs.weight": "rope_freqs"}
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k",
    "attn_v.weight": "v", "attn_output.weight": "o", "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias", "attn_v.bias": "v_bias", "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_ffn_norm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
# llama.cpp's Gemma 3 defaults when the file does not say (models/gemma3.cpp, llama-hparams.h).
_GEMMA3_SWA_PATTERN, _GEMMA3_SWA_ROPE_BASE = 6, 10000.0


def _open_reader(path: str) -> GGUFFile:
    return GGUFFile(path)


def load_gguf_tokenizer(path: str):
    from ember_cupy.tokenizer import Tokenizer
    return Tokenizer.from_gguf(_open_reader(path))


def load_gguf(path: str, progress: ProgressCallback | None = None) -> Checkpoint:
    reader = _open_reader(path)
    facts = _facts(reader)
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; "
                         f"supported: {SUPPORTED_ARCHITECTURES}")
    from ember_cupy.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_gguf(reader)
    config = _model_config(reader, arch, tokenizer, path)
    weights = _read_weights(reader, config, progress)
    check_weight_shapes(weights, config, path)
    prepare_linear_weights(weights, config.num_layers)
    if "lm_head" not in weights:
        config = _replace(config, tie_word_embeddings=True)
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, source=path, facts=facts)


def describe_gguf(path: str) -> ModelFacts:
    return _facts(_open_reader(path))


def _facts(reader: GGUFFile) -> ModelFacts:
    return ModelFacts(architecture=str(field_value(reader, "general.architecture", "unknown")),
                      file_type=_file_type_name(field_value(reader, "general.file_type")),
                      num_parameters=sum(int(np.prod(t.shape, dtype=np.int64)) for t in reader.tensors))


def _file_type_name(value) -> str:
    """GGUF's general.file_type by llama.cpp's name (15 -> Q4_K_M); "unknown" when absent."""
    from gguf import LlamaFileType
    try:
        name = LlamaFileType(int(value)).name
    except (TypeError, ValueError):
        return "unknown"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _replace(config: ModelConfig, **changes) -> ModelConfig:
    from dataclasses import replace
    return replace(config, **changes)


def _model_config(reader, arch: str, tokenizer, path: str) -> ModelConfig:
    get = lambda key, default=None: field_value(reader, f"{arch}.{key}", default)  # noqa: E731

    def size(key: str, default=None) -> int:
        value = get(key, default)
        if type(value) is not int or value < 1:
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} must be a positive whole number, got {value!r}")
        return value

    hidden = size("embedding_length")
    heads = size("attention.head_count")
    head_dim = size("attention.key_length", hidden // heads)
    scaling_type = get("rope.scaling.type")
    rope_scaling = None
    if scaling_type and scaling_type != "none":
        rope_scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
    vocab = size("vocab_size", len(tokenizer))
    layers = size("block_count")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=size("feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=size("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=size("context_length", 2048),
        attention_bias=arch == "qwen2",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        add_bos_token=tokenizer.add_bos_token,
        name=str(field_value(reader, "general.name", "model")),
        qk_norm=arch in ("qwen3", "gemma3"),
        **(_gemma3_features(get, hidden, heads, head_dim, layers) if arch == "gemma3" else {}),
    )


def _gemma3_features(get, hidden: int, heads: int, head_dim: int, layers: int) -> dict:
    """llama.cpp's Gemma 3 (models/gemma3.cpp): sliding layers by pattern (every n-th layer global,
    or an explicit per-layer array), their RoPE base, and the attention scale (27B: hidden/heads)."""
    window = get("attention.sliding_window")
    pattern = get("attention.sliding_window_pattern", _GEMMA3_SWA_PATTERN)
    if isinstance(pattern, list):
        sliding = tuple(bool(p) for p in pattern)
    else:
        sliding = tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(layers))
    scale_dim = hidden // heads if layers == 62 else head_dim
    return dict(sandwich_norms=True, hidden_act="gelu_tanh", embedding_scale=float(np.sqrt(hidden)),
                attention_scale=scale_dim ** -0.5,
                sliding_window=int(window) if window else None, sliding_layers=sliding if window else None,
                rope_local_theta=float(get("rope.freq_base_swa", _GEMMA3_SWA_ROPE_BASE)) if window else None)


def _read_weights(reader, config: ModelConfig, progress) -> dict[str, np.ndarray]:
    weights = {}
    total = len(reader.tensors)
    for done, tensor in enumerate(reader.tensors, 1):
        name = _canonical_name(tensor.name)
        if name is not None:
            weights[name] = _unpermute_qk(name, _read_tensor(tensor), config)
        if progress:
            progress(done, total)
    return weights


def _canonical_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def _read_tensor(tensor) -> np.ndarray | QuantizedTensor:
    """Float tensors as float32 arrays; quantized and 16-bit float matrices as their blocks (bits),
    a view of the file (the model packs them into its own arrays; then nothing holds the file's pages)."""
    from gguf import GGMLQuantizationType as QT
    rows = int(tensor.shape[1]) if len(tensor.shape) == 2 else 0
    if tensor.tensor_type in (QT.F16, QT.BF16) and rows:
        return half_tensor(np.asarray(tensor.data).reshape(rows, -1).view(np.uint16), tensor.tensor_type.name)
    if tensor.tensor_type == QT.F32 or not rows:
        return _dequantize(tensor)
    return QuantizedTensor(tensor.tensor_type.name, tensor.data.reshape(rows, -1), (rows, int(tensor.shape[0])))


def _dequantize(tensor) -> np.ndarray:
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize

    raw = tensor.data
    if tensor.tensor_type == QT.F32:
        data = raw.view(np.float32).copy()          # a copy: a view would keep the file mapped
    elif tensor.tensor_type == QT.F16:
        data = raw.view(np.float16).astype(np.float32)
    elif tensor.tensor_type == QT.BF16:
        data = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif tensor.tensor_type.name.startswith(("Q", "I", "T")):
        data = dequantize(raw, tensor.tensor_type).astype(np.float32, copy=False)
    else:
        raise ValueError(f"tensor {tensor.name}: unsupported GGUF type {tensor.tensor_type.name}")
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    return np.ascontiguousarray(data.reshape(shape))


def _unpermute_qk(name: str, weight, config: ModelConfig):
    """Undo llama.cpp's q/k row permutation so the model can use HF rotate-half RoPE.

    The converter interleaves the two halves of every head's rows (pairs adjacent for the
    GGML RoPE); mixing layouts is invisible at position 0 and wrong everywhere else.
    """
    kind = name.rsplit(".", 1)[-1]
    if kind not in ("q", "k", "q_bias", "k_bias") or config.architecture != "llama":
        return weight
    heads = config.num_heads if kind.startswith("q") else config.num_kv_heads
    if isinstance(weight, QuantizedTensor):   # rows are whole blocks: permute them as rows
        order = _unpermute_qk(name, np.arange(weight.shape[0]), config)
        permuted = weight.take_rows(order)
        release_pages(weight.data)
        return permuted
    rows = weight.shape[0]
    per_head = rows // heads
    restored = weight.reshape(heads, per_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(restored.reshape(weight.shape))
