"""Fused ops of the forward pass. Each has one signature and two implementations: a NumPy twin
(the reference and the CPU path) and a CUDA kernel from cuda/*.cu launched through CuPy."""
from ember_cupy.ops.activation import gelu_tanh_and_mul, silu_and_mul
from ember_cupy.ops.attention import paged_attention
from ember_cupy.ops.cache import write_kv
from ember_cupy.ops.norm import fused_add_rms_norm, rms_norm
from ember_cupy.ops.rotary import RopeTable, apply_rope, rope_cos_sin_cache

__all__ = ["RopeTable", "apply_rope", "fused_add_rms_norm", "gelu_tanh_and_mul", "paged_attention", "rms_norm", "rope_cos_sin_cache",
           "silu_and_mul", "write_kv"]
