"""The decoder-only transformer of every family served (Llama, Mistral, Qwen2, Qwen3, Gemma 3,
SmolLM), composed from ops/.

One forward runs one flattened batch: every scheduled token of every sequence is a row of a
[T, hidden] matrix, so each linear layer is a single GEMM, and attention reads K/V through the
block tables of the paged cache.

The families differ by ModelConfig switches: Qwen3 and Gemma 3 normalise each q/k head (qk_norm);
Gemma 3 also scales the embeddings, normalises the outputs of attention and MLP before adding
them to the residual (sandwich_norms), gates its MLP with GELU-tanh, and alternates sliding-window
layers (their own RoPE base) with global ones; Mistral's layers all slide.

On NumPy with host kernels, every family's decoder layers run as one host call each (ops/layer.py,
cpu/layer.c) when all layers' matrices are packed (quantized or 16-bit) weights; otherwise, or with
`fuse_layers = False`, they run op by op from Python: the fused path's twin.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember_cupy import ops
from ember_cupy.config import ModelConfig
from ember_cupy.model import host_fallback
from ember_cupy.model.checkpoint import Checkpoint
from ember_cupy.model.weights import is_quantized, linear_weight, vocab_matrix
from ember_cupy.ops import _cuda, _host
from ember_cupy.ops.layer import LayerStack, decoder_layers, fused_layer_computes, layer_args, step_args
from ember_cupy.ops.linear import bf16_prompts_ready, embedding, linear, matmul_q
from ember_cupy.half_weight import HalfWeight
from ember_cupy.packed_weight import PackedWeight, StackedWeight
from ember_cupy.quant import ActivationQuantization, DeviceQuantizedWeight, DeviceStack


_LM_HEAD_SLICE = 1024
_LM_HEAD_SLICE_FP32 = 16384   # rows of the 16-bit LM head cast to float32 at a time (device)


@dataclass
class BatchMetadata:
    """Per-step layout of the flattened batch, built once by the runner for all layers."""

    positions: object         # [T] int32
    slot_mapping: object      # [T] int32, slot in the KV pool of each new token (-1 = skip)
    block_tables: object      # [S, max_blocks] int32
    context_lens: object      # [S] int32, tokens in the cache after this step
    query_start_loc: object   # [S+1] int32, row offsets of each sequence in the batch
    logits_indices: object    # [N] int, rows whose next-token logits are needed
    prompt_rows: object = None  # [T] bool, prompt tokens' rows (host: their matmuls in bf16), or None


@dataclass
class LayerWeights:
    attn_norm: object
    qkv: object               # q/k/v fused into one matmul (float [in, out] or QuantizedTensor [out, in])
    qkv_bias: object | None
    o: object
    ffn_norm: object
    gate_up: object           # gate/up fused into one matmul
    down: object
    q_norm: object | None = None          # [head_dim] (qk_norm)
    k_norm: object | None = None
    post_attn_norm: object | None = None  # [hidden] (sandwich_norms)
    post_ffn_norm: object | None = None


class DecoderModel:
    def __init__(self, checkpoint: Checkpoint, xp=np, dtype=np.float32, quantization: str = "none",
                 consume: bool = False, activations: ActivationQuantization = ActivationQuantization(passes=2),
                 deterministic: bool = False, weight_cache=None, prompt_activations: str = "int8"):
        """quantization: serving format of the matrices (ember_cupy/model/weights.py); consume:
        drop each checkpoint tensor once converted, so that the weights are held once;
        activations: how a host-quantized matmul quantizes its input (quant.ActivationQuantization);
        deterministic: the device kernels' batch-invariant choices (EngineConfig.deterministic);
        weight_cache: a WeightCache the host format of the matrices is mapped from or packed into;
        prompt_activations: "auto" = prompt rows in bf16 where the host kernels have AMX-BF16 tiles
        or AVX512-BF16 vectors (EngineConfig.prompt_activations), "int8" = as every other row."""
        self.activations = activations
        self.prompt_rows_in_bf16 = prompt_activations == "auto" and xp is np and bf16_prompts_ready()
        self.deterministic = deterministic
        self._fused_key, self._fused = None, None     # per-layer host-call arguments, per KV pool
        self.config: ModelConfig = checkpoint.config
        self.xp = xp
        self.dtype = dtype
        cfg = self.config
        put = lambda array: xp.asarray(np.ascontiguousarray(array, dtype=dtype))  # noqa: E731
        take = checkpoint.take if consume else checkpoint.require
        self.embed = vocab_matrix(take("embed"), quantization, put, xp, weight_cache)
        self.norm = put(take("norm"))
        self.lm_head = self.embed if cfg.tie_word_embeddings else vocab_matrix(take("lm_head"), quantization, put, xp,
                                                                               weight_cache)
        self.layers = [self._layer(take, checkpoint.weights, i, put, quantization, xp, weight_cache)
                       for i in range(cfg.num_layers)]
        if weight_cache is not None:
            weight_cache.finish()
        freq_factors = checkpoint.weights.get("rope_freqs")   # llama.cpp's llama3 RoPE scaling
        self.rope = ops.RopeTable(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                  None if freq_factors is not None else cfg.rope_scaling,
                                  freq_factors=freq_factors, xp=xp)
        self.local_rope = self.rope if cfg.rope_local_theta is None else ops.RopeTable(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta, xp=xp)
        self.scale = cfg.attention_scale or cfg.head_dim ** -0.5
        self._fusable = fused_layer_computes(cfg)
        if xp is np:
            host_fallback.report(self.served_weights())

    @staticmethod
    def _layer(take, weights: dict, index: int, put, quantization: str, xp, weight_cache) -> LayerWeights:
        get = lambda name: take(f"layers.{index}.{name}")  # noqa: E731
        matrix = lambda name: linear_weight(get(name), quantization, put, xp, weight_cache)  # noqa: E731
        optional = lambda name: put(get(name)) if f"layers.{index}.{name}" in weights else None  # noqa: E731
        return LayerWeights(
            attn_norm=put(get("attn_norm")),
            qkv=matrix("qkv"),
            qkv_bias=optional("qkv_bias"),
            o=matrix("o"),
            ffn_norm=put(get("ffn_norm")),
            gate_up=matrix("gate_up"),
            down=matrix("down"),
            q_norm=optional("q_norm"),
            k_norm=optional("k_norm"),
            post_attn_norm=optional("post_attn_norm"),
            post_ffn_norm=optional("post_ffn_norm"),
        )

    def served_weights(self) -> list:
        """Every weight tensor as served, once (the tied LM head is the embedding table)."""
        seen, tensors = set(), []
        for tensor in [self.embed, self.norm, self.lm_head, *(v for layer in self.layers
                                                              for v in vars(layer).values())]:
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
        return tensors

    def every_matmul_quantized(self) -> bool:
        """Every matrix (each layer's and the LM head) runs as a quantized matmul of the host
        kernels or the device's GEMV, whose rows do not depend on each other (a float matrix goes
        through NumPy's or cuBLAS's GEMM)."""
        matrices = [self.lm_head] + [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return all(isinstance(m, (PackedWeight, StackedWeight, HalfWeight, DeviceQuantizedWeight, DeviceStack))
                   for m in matrices)

    def weight_bytes(self) -> int:
        """Bytes of all weights as served (the tied LM head counted once)."""
        return sum(int(tensor.nbytes) for tensor in self.served_weights())

    def reserve_positions(self, positions: int) -> None:
        """Grow the RoPE tables to cover positions [0, positions) before a step reads them."""
        self.rope.reserve(positions)
        self.local_rope.reserve(positions)

    def forward(self, input_ids, batch: BatchMetadata, kv_caches: list[tuple]):
        """input_ids [T] -> logits [len(logits_indices), vocab] (float32)."""
        return self.logits(self.hidden_states(input_ids, batch, kv_caches))

    def hidden_states(self, input_ids, batch: BatchMetadata, kv_caches: list[tuple]):
        """input_ids [T] -> the final-normed hidden states of the logits_indices rows
        [len(logits_indices), hidden]: what the LM head reads, and what embeddings pool."""
        cfg = self.config
        hidden = embedding(self.embed, input_ids, self.dtype)
        if cfg.embedding_scale != 1.0:
            hidden = hidden * hidden.dtype.type(cfg.embedding_scale)
        fused = None if _cuda.wants_kernel(hidden) else self._fused_layers(kv_caches)
        if fused is not None:
            return self._forward_fused(hidden, batch, fused)
        if cfg.sandwich_norms:
            return self._forward_sandwich(hidden, batch, kv_caches)
        residual = None
        for index, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, layer.attn_norm, cfg.rms_norm_eps)
            else:
                x, residual = ops.fused_add_rms_norm(hidden, residual, layer.attn_norm, cfg.rms_norm_eps)
            hidden = self._attention(x, index, layer, batch, k_cache, v_cache)
            x, residual = ops.fused_add_rms_norm(hidden, residual, layer.ffn_norm, cfg.rms_norm_eps)
            hidden = self._mlp(x, layer, batch)
        return self._final_norm(hidden, residual, batch)

    def _forward_sandwich(self, hidden, batch: BatchMetadata, kv_caches):
        """Gemma 3: residual += norm(attention(norm(residual))); residual += norm(mlp(norm(residual)))."""
        eps = self.config.rms_norm_eps
        for index, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            x = self._attention(ops.rms_norm(hidden, layer.attn_norm, eps), index, layer, batch, k_cache, v_cache)
            hidden = hidden + ops.rms_norm(x, layer.post_attn_norm, eps)
            x = self._mlp(ops.rms_norm(hidden, layer.ffn_norm, eps), layer, batch)
            hidden = hidden + ops.rms_norm(x, layer.post_ffn_norm, eps)
        return self._final_norm(hidden, None, batch)

    def _prompt_rows(self, batch: BatchMetadata):
        """The rows whose matmuls run in bf16 (ops/linear.py linear), or None."""
        return batch.prompt_rows if self.prompt_rows_in_bf16 else None

    def _final_norm(self, hidden, residual, batch: BatchMetadata):
        """The final norm of the logits_indices rows: of hidden + residual, or of hidden where it
        is the residual stream itself (sandwich norms: residual None)."""
        rows, eps = batch.logits_indices, self.config.rms_norm_eps
        if residual is None:
            return ops.rms_norm(hidden[rows], self.norm, eps)
        x, _ = ops.fused_add_rms_norm(hidden[rows], residual[rows], self.norm, eps)
        return x

    def _mlp(self, x, layer: LayerWeights, batch: BatchMetadata):
        gate_up = linear(x, layer.gate_up, self.activations, self.deterministic, self._prompt_rows(batch))
        activated = ops.silu_and_mul(gate_up) if self.config.hidden_act == "silu" else ops.gelu_tanh_and_mul(gate_up)
        return linear(activated, layer.down, self.activations, self.deterministic, self._prompt_rows(batch))

    # --- one host-kernel call for all layers (ops/layer.py); the loop above is its twin ------
    fuse_layers = True      # tools/profile_step.py turns it off to time the ops one by one

    def _fused_layers(self, kv_caches):
        if not self.fuse_layers or not self._fusable or self.xp is not np:
            return None
        library = _host.active()
        if library is None:
            return None
        key = tuple(id(k) for k, _ in kv_caches)
        if self._fused_key != key:
            cfg = self.config
            args = [layer_args(layer, k, v, cfg.layer_window(i), cfg.sandwich_norms)
                    for i, (layer, (k, v)) in enumerate(zip(self.layers, kv_caches))]
            self._fused = None if any(a is None for a in args) else (library, LayerStack(args), kv_caches)
            self._fused_key = key
        return self._fused

    def _forward_fused(self, hidden, batch: BatchMetadata, fused):
        library, stack, kv_caches = fused
        cfg = self.config
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        residual = None if cfg.sandwich_norms else np.empty_like(hidden)
        step, keep = step_args(cfg, batch, hidden.shape[0], kv_caches[0][0], self.rope.table,
                               self.local_rope.table, self.scale, self.activations, self._prompt_rows(batch))
        decoder_layers(library, stack, step, hidden, residual)
        del keep
        return self._final_norm(hidden, residual, batch)

    def logits(self, x):
        """x @ lm_head.T. For 2-24 rows on NumPy, lm_head @ x.T over slices of 1024 vocab rows
        is 1.3-1.6x faster with OpenBLAS (measured): the big matrix is not packed in one go; its
        rows are the bits of x @ lm_head.T's, and a lone row is computed as two of them."""
        if is_quantized(self.lm_head):
            return matmul_q(x, self.lm_head, activations=self.activations, out_dtype=np.float32,
                            deterministic=self.deterministic)
        rows = x.shape[0]
        if self.xp is not np:
            return self._logits_fp32(x)
        if rows == 1:   # as two rows: the same bits as in a batch (ops/linear.py float_matmul)
            return self.logits(np.concatenate([x, x]))[:1]
        if rows > 24:
            return x @ self.lm_head.T
        vocab = self.lm_head.shape[0]
        out = np.empty((vocab, rows), dtype=np.result_type(x, self.lm_head))
        x_t = x.T
        for start in range(0, vocab, _LM_HEAD_SLICE):
            np.matmul(self.lm_head[start:start + _LM_HEAD_SLICE], x_t, out=out[start:start + _LM_HEAD_SLICE])
        return np.ascontiguousarray(out.T)

    def _logits_fp32(self, x):
        """Device logits in float32 whatever the weights' dtype (16-bit logits tie the argmax):
        float32 GEMMs over slices of the LM head cast on the fly, so the extra memory is one
        slice. (cuBLAS GemmEx with a float32 output would avoid the casts.)"""
        xp = self.xp
        if self.lm_head.dtype == np.float32:
            return x @ self.lm_head.T
        vocab = self.lm_head.shape[0]
        out = xp.empty((x.shape[0], vocab), dtype=np.float32)
        x32 = x.astype(np.float32)
        for start in range(0, vocab, _LM_HEAD_SLICE_FP32):
            stop = min(start + _LM_HEAD_SLICE_FP32, vocab)
            out[:, start:stop] = x32 @ self.lm_head[start:stop].astype(np.float32).T
        return out

    def _attention(self, x, index: int, layer: LayerWeights, batch: BatchMetadata, k_cache, v_cache):
        cfg = self.config
        qkv = linear(x, layer.qkv, self.activations, self.deterministic, self._prompt_rows(batch))
        if layer.qkv_bias is not None:
            qkv += layer.qkv_bias
        num_tokens = x.shape[0]
        q = qkv[:, :cfg.q_size].reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, cfg.q_size + cfg.kv_size:].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q, k = self._head_norm(q, layer.q_norm), self._head_norm(k, layer.k_norm)
        window = cfg.layer_window(index)
        cos_sin = (self.local_rope if window else self.rope).table
        ops.apply_rope(q, k, batch.positions, cos_sin, is_neox=True)
        ops.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = ops.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                                  batch.query_start_loc, self.scale, window, self.deterministic)
        return linear(out.reshape(num_tokens, cfg.q_size), layer.o, self.activations, self.deterministic,
                      self._prompt_rows(batch))

    def _head_norm(self, x, weight):
        """RMSNorm over each head of x [T, H, D] (a new contiguous array)."""
        tokens, heads, head_dim = x.shape
        flat = self.xp.ascontiguousarray(x).reshape(tokens * heads, head_dim)
        return ops.rms_norm(flat, weight, self.config.rms_norm_eps).reshape(tokens, heads, head_dim)
