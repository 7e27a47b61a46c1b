"""Hugging Face checkpoints: config.json + *.safetensors (sharded or not) + tokenizer.json."""
from __future__ import annotations

import glob
import json
import os

import numpy as np

from ember_cupy.config import ModelConfig
from ember_cupy.json_file import read_json_object
from ember_cupy.model.checkpoint import (
    Checkpoint,
    ModelFacts,
    ProgressCallback,
    check_weight_shapes,
    prepare_linear_weights,
)
from ember_cupy.quant import HALF_TYPES, half_tensor

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o", "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias", "self_attn.v_proj.bias": "v_bias",
    "post_attention_layernorm.weight": "ffn_norm", "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
}
# Gemma 3 names its four norms differently (post_attention_layernorm is after attention, not
# before the MLP), and computes x * (1 + w): stored as 1 + w here, as llama.cpp's converter does.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES, "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "ffn_norm", "post_feedforward_layernorm.weight": "post_ffn_norm",
}
_GEMMA3_SWA_PATTERN = 6
_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm",
                 "lm_head.weight": "lm_head"}


def _read_config(path: str) -> dict:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path} has no config.json")
    raw = read_json_object(config_file)
    for key in _REQUIRED_SIZES + _OPTIONAL_SIZES:
        value = raw.get(key)
        if (value is not None or key in _REQUIRED_SIZES) and (type(value) is not int or value < 1):
            raise ValueError(f"{config_file}: {key} must be a positive whole number, got {value!r}")
    return raw


_REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")


def load_hf_tokenizer(path: str, raw: dict | None = None):
    from ember_cupy.tokenizer import Tokenizer
    return Tokenizer.from_hf_directory(path, eos_token_ids=_eos_ids(raw or _read_config(path), path))


def load_hf_directory(path: str, progress: ProgressCallback | None = None) -> Checkpoint:
    raw = _read_config(path)
    arch = _architecture(raw, path)
    tokenizer = load_hf_tokenizer(path, raw)
    config = model_config_from_hf(raw, arch, tokenizer, name=os.path.basename(os.path.normpath(path)))
    weights = _read_safetensors(path, _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES, progress)
    check_weight_shapes(weights, config, path)
    if arch == "gemma3":
        for name in weights:
            if name.endswith("norm"):
                weights[name] = weights[name] + np.float32(1.0)
    prepare_linear_weights(weights, config.num_layers)
    if not config.tie_word_embeddings and "lm_head" not in weights:
        raise ValueError(f"{path}: lm_head.weight missing and tie_word_embeddings is false")
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, source=path,
                      stored_dtype=_stored_dtype(path), facts=describe_hf(path, raw))


def describe_hf(path: str, raw: dict | None = None) -> ModelFacts:
    raw = _read_config(path) if raw is None else raw
    count = 0
    for file in _shard_files(path):
        entries, _ = _safetensors_header(file)
        count += sum(int(np.prod(e["shape"], dtype=np.int64)) for n, e in entries.items() if n != "__metadata__")
    return ModelFacts(architecture=_architecture(raw, path), file_type=_FILE_TYPES.get(_stored_dtype(path), "unknown"),
                      num_parameters=count)


def _architecture(raw: dict, path: str) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    raise ValueError(f"{path}: unsupported architecture {names or raw.get('model_type')!r}; "
                     f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")


def _eos_ids(raw: dict, path: str) -> tuple[int, ...]:
    ids = []
    sources = [raw]
    generation_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(generation_file):
        sources.append(read_json_object(generation_file))
    for source in sources:
        value = source.get("eos_token_id")
        ids += value if isinstance(value, list) else [value] if value is not None else []
    return tuple(ids)


def model_config_from_hf(raw: dict, arch: str, tokenizer, name: str = "model") -> ModelConfig:
    heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    layers = raw["num_hidden_layers"]
    sliding = _sliding_layers(raw, arch, layers)
    window = raw.get("sliding_window") if any(sliding) else None
    rope_theta, rope_scaling, local_theta = _rope(raw)
    gemma = arch == "gemma3"
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden activation {act!r}; supported: {sorted(_ACTIVATIONS)}")
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", gemma),
        attention_bias=raw.get("attention_bias", arch == "qwen2"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tokenizer.eos_token_ids,
        add_bos_token=tokenizer.add_bos_token,
        name=name,
        qk_norm=arch in ("qwen3", "gemma3"),
        sandwich_norms=gemma,
        hidden_act=_ACTIVATIONS[act],
        embedding_scale=float(np.sqrt(hidden)) if gemma else 1.0,
        attention_scale=raw.get("query_pre_attn_scalar", 256) ** -0.5 if gemma else None,
        sliding_window=window,
        sliding_layers=tuple(sliding) if window else None,
        rope_local_theta=local_theta if gemma and window else None,
    )


_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _sliding_layers(raw: dict, arch: str, layers: int) -> list[bool]:
    """Which layers use `sliding_window`: config.json's layer_types when it has them, else each
    family's rule in transformers (Mistral: all; Qwen2/3: use_sliding_window from
    max_window_layers on; Gemma 3: all but every sliding_window_pattern-th)."""
    if not raw.get("sliding_window"):
        return [False] * layers
    if raw.get("layer_types"):
        return [t == "sliding_attention" for t in raw["layer_types"]]
    if arch == "mistral":
        return [True] * layers
    if arch in ("qwen2", "qwen3"):
        first = raw.get("max_window_layers", layers)
        return [bool(raw.get("use_sliding_window")) and i >= first for i in range(layers)]
    if arch == "gemma3":
        pattern = raw.get("sliding_window_pattern", _GEMMA3_SWA_PATTERN)
        return [(i + 1) % pattern != 0 for i in range(layers)]
    return [False] * layers


def _rope(raw: dict) -> tuple[float, dict | None, float]:
    """(global base, global scaling, sliding layers' base) from rope_theta / rope_scaling /
    rope_local_base_freq, or from transformers 5's rope_parameters (per layer type or not)."""
    params = raw.get("rope_parameters")
    if params and "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention", params["full_attention"])
        return float(full.get("rope_theta", 10000.0)), _scaling(full), float(local.get("rope_theta", 10000.0))
    if params:
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        return theta, _scaling(params), float(raw.get("rope_local_base_freq", theta))
    theta = float(raw.get("rope_theta", 10000.0))
    return theta, raw.get("rope_scaling"), float(raw.get("rope_local_base_freq", 10000.0))


def _scaling(params: dict) -> dict | None:
    return None if params.get("rope_type", "default") == "default" else params


def _shard_files(path: str) -> list[str]:
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        weight_map = read_json_object(index_file).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_file}: no weight_map object")
        shards = sorted(set(map(str, weight_map.values())))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(f"{path}: shard(s) listed in the index are missing: {missing}")
        return [os.path.join(path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    return files


def _read_safetensors(path: str, layer_names: dict, progress) -> dict[str, np.ndarray]:
    import ml_dtypes  # noqa: F401  (registers NumPy's bfloat16, which safetensors' numpy reader needs)
    from safetensors import safe_open

    weights = {}
    files = _shard_files(path)
    for done, file in enumerate(files, 1):
        entries, data_start = _safetensors_header(file)
        try:
            with safe_open(file, framework="np") as f:
                for hf_name in f.keys():
                    name = _canonical_name(hf_name, layer_names)
                    if name is None:
                        continue
                    entry = entries[hf_name]
                    if entry["dtype"] in HALF_TYPES and len(entry["shape"]) == 2:
                        weights[name] = _half_matrix(file, entry, data_start)
                    else:
                        weights[name] = np.asarray(f.get_tensor(hf_name), dtype=np.float32)
        except (ValueError, OSError):
            raise
        except Exception as exc:   # safetensors' SafetensorError, and what a damaged file makes of it
            raise ValueError(f"{file}: not a safetensors file this library can read ({exc})") from None
        if progress:
            progress(done, len(files))
    return weights


def _safetensors_header(file: str) -> tuple[dict, int]:
    """The file's tensor entries ({name: {dtype, shape, data_offsets}}) and where their data starts;
    ValueError when the file is cut short (an interrupted download) or its header damaged."""
    file_bytes = os.path.getsize(file)
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if file_bytes < 8 or 8 + size > file_bytes:
            raise ValueError(f"{file}: the file ends inside its safetensors header ({file_bytes} bytes): "
                             "it is cut short (an interrupted download?) or damaged")
        try:
            entries = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file}: a damaged safetensors header ({exc})") from None
    if not isinstance(entries, dict):
        raise ValueError(f"{file}: a damaged safetensors header (not a JSON object)")
    data_bytes = file_bytes - 8 - size
    for name, entry in entries.items():
        if name != "__metadata__" and not _inside(entry, data_bytes):
            raise ValueError(f"{file}: tensor {name} lies beyond the end of the file ({file_bytes} bytes): "
                             "it is cut short (an interrupted download?) or damaged")
    return entries, 8 + size


def _inside(entry, data_bytes: int) -> bool:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    return (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes)


def _half_matrix(file: str, entry: dict, data_start: int):
    """A 16-bit float matrix as its bits (a QuantizedTensor of qtype F16/BF16: served in 16 bits,
    model/weights.py), read into its own array: no float32 copy, and no mapping of the file that
    would keep its pages resident beside it (safe_open's)."""
    begin, end = entry["data_offsets"]
    rows, cols = entry["shape"]
    if end - begin != 2 * rows * cols:
        raise ValueError(f"{file}: a {entry['dtype']} tensor of shape {entry['shape']} holds {end - begin} bytes")
    bits = np.fromfile(file, dtype="<u2", count=rows * cols, offset=data_start + begin)
    return half_tensor(bits.astype(np.uint16, copy=False).reshape(rows, cols), entry["dtype"])


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_FILE_TYPES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


def _stored_dtype(path: str) -> str | None:
    """The float dtype the checkpoint's matrices are stored in (read from a file header)."""
    from safetensors import safe_open

    with safe_open(_shard_files(path)[0], framework="np") as f:
        for name in f.keys():
            dtype = _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
            if dtype is not None and len(f.get_slice(name).get_shape()) == 2:
                return dtype
    return None


def _canonical_name(hf_name: str, layer_names: dict) -> str | None:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[0] == "model" and parts[1] == "layers" and parts[3] in layer_names:
        return f"layers.{parts[2]}.{layer_names[parts[3]]}"
    return None
