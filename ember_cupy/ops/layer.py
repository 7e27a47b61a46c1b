"""A whole Llama decoder layer in one host-kernel call (cpu/layer.c), for steps whose weights are
all packed and whose arrays suit the host kernels. Its twin is LlamaModel's op-by-op forward:
the same kernels called one by one from Python (tests/test_fused_layer.py holds them equal)."""
from __future__ import annotations

import ctypes

import numpy as np

from ember_cupy.ops import _host
from ember_cupy.ops.attention import HOST_CACHE_DTYPES
from ember_cupy.ops.linear import weight_parts
from ember_cupy.packed_weight import PackedWeight, StackedWeight
from ember_cupy.quant import ActivationQuantization

_P, _I32, _I64, _F = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class LayerWeightsArgs(ctypes.Structure):
    _fields_ = [("attn_norm", _P), ("ffn_norm", _P), ("qkv_bias", _P), ("qkv", _P), ("o", _P),
                ("gate_up", _P), ("down", _P), ("qkv_parts", _I32), ("o_parts", _I32),
                ("gate_up_parts", _I32), ("down_parts", _I32), ("k_cache", _P), ("v_cache", _P)]


class StepArgs(ctypes.Structure):
    _fields_ = [("tokens", _I64), ("hidden", _I64), ("inter", _I64), ("heads", _I32), ("kv_heads", _I32),
                ("head_dim", _I32), ("passes", _I32), ("neox", _I32), ("cache_f16", _I32),
                ("block_size", _I32), ("num_seqs", _I32), ("max_blocks", _I32), ("num_blocks", _I64),
                ("table_stride", _I64), ("eps", _F), ("scale", _F), ("second_pass_threshold", _F),
                ("positions", _P), ("slot_mapping", _P), ("block_tables", _P), ("context_lens", _P),
                ("query_start_loc", _P), ("cos_sin", _P)]


_host.register_signature("ember_llama_layer", [_P, _P, _P, _P, _I32], ctypes.c_int)


def layer_args(layer, k_cache: np.ndarray, v_cache: np.ndarray) -> LayerWeightsArgs | None:
    """The fixed arguments of one layer, or None when it cannot run fused."""
    matrices = (layer.qkv, layer.o, layer.gate_up, layer.down)
    floats = [layer.attn_norm, layer.ffn_norm] + ([] if layer.qkv_bias is None else [layer.qkv_bias])
    if not all(isinstance(m, (PackedWeight, StackedWeight)) for m in matrices) or not _host.rows_f32(*floats):
        return None
    if k_cache.dtype not in HOST_CACHE_DTYPES or not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        return None
    parts = [weight_parts(m) for m in matrices]
    args = LayerWeightsArgs(
        layer.attn_norm.ctypes.data, layer.ffn_norm.ctypes.data,
        None if layer.qkv_bias is None else layer.qkv_bias.ctypes.data,
        *(ctypes.addressof(p) for p in parts), *(len(p) for p in parts),
        k_cache.ctypes.data, v_cache.ctypes.data)
    args.parts = parts          # the part arrays the struct points into live as long as it does
    return args


def step_args(config, batch, num_tokens: int, k_cache: np.ndarray, cos_sin: np.ndarray, scale: float,
              activations: ActivationQuantization) -> tuple[StepArgs, list]:
    """The per-step arguments, and the arrays they point into (keep them alive for the call)."""
    keep = [np.ascontiguousarray(a, dtype=np.int32) for a in
            (batch.positions, batch.slot_mapping, batch.block_tables, batch.context_lens, batch.query_start_loc)]
    positions, slots, tables, lens, starts = keep
    if len(positions) and (positions.min() < 0 or positions.max() >= len(cos_sin)):
        raise ValueError("llama_layer: a position outside the cos/sin cache")
    args = StepArgs(
        num_tokens, config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
        config.head_dim, activations.passes, 1, HOST_CACHE_DTYPES[k_cache.dtype], k_cache.shape[1], len(lens),
        tables.shape[1], k_cache.shape[0], tables.shape[1], config.rms_norm_eps, scale,
        activations.second_pass_threshold,
        positions.ctypes.data, slots.ctypes.data, tables.ctypes.data, lens.ctypes.data,
        starts.ctypes.data, cos_sin.ctypes.data)
    return args, keep


def llama_layer(library, weights: LayerWeightsArgs, step: StepArgs, hidden: np.ndarray,
                residual: np.ndarray, first: bool) -> None:
    """In place: hidden <- the layer's output, residual <- the residual stream after it."""
    status = library.lib.ember_llama_layer(ctypes.byref(weights), ctypes.byref(step), hidden.ctypes.data,
                                           residual.ctypes.data, int(first))
    if status:
        raise RuntimeError(f"ember_llama_layer failed with status {status}")
