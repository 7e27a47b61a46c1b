"""The ctypes signature of every host-kernel entry point (cpu/*.c), in one table: name ->
(argtypes, restype). HostLibrary declares them all when it loads a library; a kernel's Python
caller (ops/*.py, engine/sampler.py, structured/bitmask.py) only calls it."""
from __future__ import annotations

from ctypes import c_char_p, c_float, c_int, c_int32, c_int64, c_void_p

_P, _I32, _I64, _F = c_void_p, c_int32, c_int64, c_float
_ROWS = [_P, _I64, _P, _I64, _I64, _I64]   # out, its row stride, x, its row stride, rows, columns

SIGNATURES: dict[str, tuple[list, object]] = {
    # library (cpu/matmul_q.c, cpu/threadpool.c)
    "ember_isa": ([], c_char_p),
    "ember_max_threads": ([], c_int),
    "ember_amx_ready": ([], c_int),
    "ember_bf16_tiles_ready": ([], c_int),
    "ember_bf16_prompts_ready": ([], c_int),
    "ember_matmul_parts_bf16": ([_P, _I64, _I64, _I64, _P, _I32, _P, _I64], c_int),
    "ember_set_num_threads": ([c_int], None),
    "ember_parallel_for": ([_I64, _P, _P], None),    # (n, range function, its context): tests only
    # quantized and 16-bit matmuls (cpu/matmul_q.c, cpu/matmul_16bit.c), packing (cpu/pack.c)
    "ember_quantize_q8": ([_P, _I64, _I64, _I64, _P, _P, _P], None),
    "ember_matmul_q": ([_P, _I64, _I64, _I64, _P, _I64, _I32, _P, _I64, _I32, _F], c_int),
    "ember_matmul_parts": ([_P, _I64, _I64, _I64, _P, _I32, _P, _I64, _I32, _F], c_int),
    "ember_matmul_16bit": ([_P, _I64, _I64, _I64, _P, _I64, _I32, _P, _I64], c_int),
    "ember_pack_weight": ([_I32, _P, _I64, _I64, _I64, _P, _I64], c_int),
    "ember_pack_16bit": ([_P, _I64, _I64, _I64, _P], c_int),
    # elementwise and the fused layer (cpu/elementwise.c, cpu/layer.c)
    "ember_rms_norm": ([_P, _I64, _P, _P, _I64, _I64, _I64, _F], None),
    "ember_fused_add_rms_norm": ([_P, _I64, _P, _I64, _P, _I64, _I64, _F], None),
    "ember_silu_and_mul": (_ROWS, None),
    "ember_gelu_tanh_and_mul": (_ROWS, None),
    "ember_rope": ([_P, _I64, _I64, _I32, _P, _I64, _I64, _I32, _I32, _P, _P, _I32, _I64], None),
    "ember_llama_layer": ([_P, _P, _P, _P, _I32], c_int),
    "ember_decoder_layers": ([_P, _I32, _P, _P, _P], c_int),
    # paged attention (cpu/attention.c)
    "ember_paged_attention_window": ([_P, _P, _I64, _I64,      # out, q, strides
                                      _P, _P, _I32, _I64,      # caches, f16, blocks
                                      _I32, _I32, _I32, _I32,  # block size, Hq, Hk, D
                                      _P, _I64, _I32,          # tables
                                      _P, _P, _I32, _F,        # lens, query starts, S, scale
                                      _I32], c_int),           # window
    # sampling (cpu/sampling.c)
    "ember_kth_largest": ([_P, _I64, _I64, _I64, _P, _P], c_int),
    "ember_argmax_rows": ([_P, _I64, _I64, _I64, _P], None),
    "ember_apply_token_bitmask": ([_P, _I64, _I64, _I64, _P, _I64, _P, _I64], c_int),
}
