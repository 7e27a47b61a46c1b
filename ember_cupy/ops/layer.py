"""A whole Llama-family decoder layer in one host-kernel call (cpu/layer.c), or every layer of a
forward in one (decoder_layers: what the model calls), for steps whose weights
are all packed (quantized, or 16-bit floats) and whose arrays suit the host kernels: Llama's layer and the other families'
features (qkv bias, qk_norm, sandwich norms, GELU-tanh MLP, per-layer sliding window and RoPE
table, attention scale). Its twin is DecoderModel's op-by-op forward: the same kernels called one
by one from Python (tests/test_fused_layer.py holds them equal)."""
from __future__ import annotations

import ctypes

import numpy as np

from ember_cupy.half_weight import HalfWeight
from ember_cupy.ops import _host
from ember_cupy.ops.attention import HOST_CACHE_DTYPES
from ember_cupy.ops.linear import weight_parts
from ember_cupy.packed_weight import PackedWeight, StackedWeight
from ember_cupy.quant import ActivationQuantization

_P, _I32, _I64, _F = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class LayerWeightsArgs(ctypes.Structure):
    _fields_ = [("attn_norm", _P), ("ffn_norm", _P), ("qkv_bias", _P), ("qkv", _P), ("o", _P),
                ("gate_up", _P), ("down", _P), ("qkv_parts", _I32), ("o_parts", _I32),
                ("gate_up_parts", _I32), ("down_parts", _I32), ("k_cache", _P), ("v_cache", _P),
                ("q_norm", _P), ("k_norm", _P), ("post_attn_norm", _P), ("post_ffn_norm", _P),
                ("window", _I32)]


class StepArgs(ctypes.Structure):
    _fields_ = [("tokens", _I64), ("hidden", _I64), ("inter", _I64), ("heads", _I32), ("kv_heads", _I32),
                ("head_dim", _I32), ("passes", _I32), ("neox", _I32), ("cache_f16", _I32),
                ("block_size", _I32), ("num_seqs", _I32), ("max_blocks", _I32), ("num_blocks", _I64),
                ("table_stride", _I64), ("eps", _F), ("scale", _F), ("second_pass_threshold", _F),
                ("positions", _P), ("slot_mapping", _P), ("block_tables", _P), ("context_lens", _P),
                ("query_start_loc", _P), ("cos_sin", _P), ("local_cos_sin", _P), ("activation", _I32),
                ("prompt_rows", _P)]


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}   # ModelConfig.hidden_act -> cpu/layer.c's ACT_*


def fused_layer_computes(config) -> bool:
    """Whether cpu/layer.c computes this config's layers (their weights decide the rest: layer_args)."""
    return config.hidden_act in ACTIVATIONS




def layer_args(layer, k_cache: np.ndarray, v_cache: np.ndarray, window: int = 0,
               sandwich: bool = False) -> LayerWeightsArgs | None:
    """The fixed arguments of one layer, or None when it cannot run fused. window: the keys its
    queries see (0: all); sandwich: Gemma 3's norms after attention and MLP (ModelConfig.sandwich_norms)."""
    matrices = (layer.qkv, layer.o, layer.gate_up, layer.down)
    family_norms = _family_norms(layer, sandwich)
    if family_norms is None:
        return None
    floats = [layer.attn_norm, layer.ffn_norm] + [a for a in (layer.qkv_bias, *family_norms) if a is not None]
    if not all(isinstance(m, (PackedWeight, StackedWeight, HalfWeight)) for m in matrices) or not _host.rows_f32(*floats):
        return None
    if k_cache.dtype not in HOST_CACHE_DTYPES or not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        return None
    parts = [weight_parts(m) for m in matrices]
    args = LayerWeightsArgs(
        layer.attn_norm.ctypes.data, layer.ffn_norm.ctypes.data, _address(layer.qkv_bias),
        *(ctypes.addressof(p) for p in parts), *(len(p) for p in parts),
        k_cache.ctypes.data, v_cache.ctypes.data,
        *(_address(a) for a in family_norms), int(window))
    args.parts = parts          # the part arrays the struct points into live as long as it does
    return args


def _family_norms(layer, sandwich: bool) -> tuple | None:
    """(q_norm, k_norm, post_attn_norm, post_ffn_norm) as the op-by-op forward uses them (None:
    not used), or None when one is missing."""
    if (layer.q_norm is None) != (layer.k_norm is None):
        return None
    post = (layer.post_attn_norm, layer.post_ffn_norm) if sandwich else (None, None)
    if sandwich and any(norm is None for norm in post):
        return None
    return layer.q_norm, layer.k_norm, *post


def _address(array) -> int | None:
    return None if array is None else array.ctypes.data


def step_args(config, batch, num_tokens: int, k_cache: np.ndarray, cos_sin: np.ndarray,
              local_cos_sin: np.ndarray, scale: float, activations: ActivationQuantization,
              prompt_rows=None) -> tuple[StepArgs, list]:
    """The per-step arguments, and the arrays they point into (keep them alive for the call).
    local_cos_sin: the RoPE table of the windowed layers (may be cos_sin itself); prompt_rows:
    [T] bools, the rows the matmuls take in bf16 (ops/linear.py linear), or None."""
    keep = [np.ascontiguousarray(a, dtype=np.int32) for a in
            (batch.positions, batch.slot_mapping, batch.block_tables, batch.context_lens, batch.query_start_loc)]
    positions, slots, tables, lens, starts = keep
    if len(positions) and (positions.min() < 0 or positions.max() >= min(len(cos_sin), len(local_cos_sin))):
        raise ValueError("decoder_layer: a position outside the cos/sin cache")
    args = StepArgs(
        num_tokens, config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
        config.head_dim, activations.passes, 1, HOST_CACHE_DTYPES[k_cache.dtype], k_cache.shape[1], len(lens),
        tables.shape[1], k_cache.shape[0], tables.shape[1], config.rms_norm_eps, scale,
        activations.second_pass_threshold,
        positions.ctypes.data, slots.ctypes.data, tables.ctypes.data, lens.ctypes.data,
        starts.ctypes.data, cos_sin.ctypes.data, local_cos_sin.ctypes.data, ACTIVATIONS[config.hidden_act])
    if prompt_rows is not None:
        roles = np.ascontiguousarray(prompt_rows, dtype=np.uint8)
        if roles.shape != (num_tokens,):
            raise ValueError("decoder_layer: prompt_rows must hold one role a row")
        args.prompt_rows = roles.ctypes.data
        keep.append(roles)
    return args, keep


class LayerStack:
    """Every layer's fixed arguments in one C array, for decoder_layers (one call a forward)."""

    def __init__(self, layers: list[LayerWeightsArgs]):
        self.array = (LayerWeightsArgs * len(layers))(*layers)
        self.layers = layers      # their part arrays, which the copies in self.array point into

    def __len__(self) -> int:
        return len(self.layers)


def decoder_layers(library, stack: LayerStack, step: StepArgs, hidden: np.ndarray, residual: np.ndarray | None) -> None:
    """In place, every layer of the stack in turn as decoder_layer does (the first with first=True),
    in one host-kernel call: a step waits for Python's GIL once, not once a layer, when another
    thread holds it (a large text's ids, a long JSON answer)."""
    status = library.lib.ember_decoder_layers(stack.array, len(stack), ctypes.byref(step), hidden.ctypes.data,
                                              _address(residual))
    if status:
        raise RuntimeError(f"ember_decoder_layers failed with status {status}")


def decoder_layer(library, weights: LayerWeightsArgs, step: StepArgs, hidden: np.ndarray,
                residual: np.ndarray | None, first: bool) -> None:
    """In place: hidden <- the layer's output, residual <- the residual stream after it; with
    sandwich norms hidden is the residual stream itself and residual is None."""
    status = library.lib.ember_llama_layer(ctypes.byref(weights), ctypes.byref(step), hidden.ctypes.data,
                                           _address(residual), int(first))
    if status:
        raise RuntimeError(f"ember_llama_layer failed with status {status}")
