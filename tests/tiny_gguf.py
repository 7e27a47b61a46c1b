"""The tiny HF checkpoints of tiny_model.py written as GGUF files, the way llama.cpp's
convert_hf_to_gguf.py writes them (written independently of the loader):

  Llama and Mistral -> arch "llama", q/k rows permuted for GGML's adjacent-pair RoPE, llama3 RoPE
                       scaling stored only as the `rope_freqs` tensor of frequency divisors;
  Qwen2 / Qwen3     -> "qwen2" / "qwen3", rows as in HF (NEOX RoPE);
  Gemma 3           -> "gemma3", every norm weight stored as 1 + w.
"""
from __future__ import annotations

import gguf
import numpy as np

from tiny_model import GEMMA3, VOCAB

ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3", GEMMA3: "gemma3"}
_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
}
_GEMMA3_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def write_tiny_gguf(path, weights: dict[str, np.ndarray], config: dict, *, pre: str = "gpt2",
                    rope_freqs: np.ndarray | None = None, quantize_matrices: bool = False,
                    half_matrices: bool = False, arch_name: str | None = None,
                    tokenizer_from: str | None = None, renamed_tokens: dict[int, str] | None = None) -> str:
    """weights/config as write_tiny_checkpoint returned/wrote them; rope_freqs: the llama3
    divisors (converter style); quantize_matrices: 2-D weights as Q8_0 blocks; half_matrices:
    2-D weights as F16 (rounded); arch_name: the general.architecture written instead (an
    unknown one, for the refusal tests); tokenizer_from: a GGUF file whose tokenizer.* fields are
    copied (weights then need its vocabulary's rows), with renamed_tokens {id: text} changed in
    its token list."""
    hf_arch = config["architectures"][0]
    arch = ARCHS[hf_arch]
    writer = gguf.GGUFWriter(str(path), arch_name or arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    scaling = config.get("rope_scaling")
    if scaling and scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if arch == "gemma3" and config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
        writer.add_uint32(f"{writer.arch}.attention.sliding_window_pattern", config.get("sliding_window_pattern", 6))
        writer.add_float32(f"{writer.arch}.rope.freq_base_swa", config["rope_local_base_freq"])
    if tokenizer_from is None:
        _add_vocabulary(writer, pre)
    else:
        _copy_vocabulary(writer, tokenizer_from, renamed_tokens or {})
    for name, tensor in _gguf_tensors(weights, config, arch).items():
        if quantize_matrices and tensor.ndim == 2:
            blocks = gguf.quants.quantize(tensor, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif half_matrices and tensor.ndim == 2:
            writer.add_tensor(name, tensor.astype(np.float16))
        else:
            writer.add_tensor(name, tensor)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    write_out(writer)
    return str(path)


def write_out(writer) -> None:
    """A gguf.GGUFWriter's header, metadata and tensors to its file, closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_vocabulary(writer, pre: str) -> None:
    """A byte-level BPE vocabulary without merges: the tests feed token ids."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(VOCAB)
    writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(VOCAB) - 2))
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)


def _copy_vocabulary(writer, source: str, renamed: dict[int, str]) -> None:
    """Its tokenizer.* fields, read by the engine's own fast reader (gguf's takes seconds on a
    49k vocabulary); their types from their values, as the converter writes them."""
    from ember_cupy.gguf_file import GGUFFile
    kinds = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32, str: gguf.GGUFValueType.STRING}
    for key, value in GGUFFile(source).metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if key == "tokenizer.ggml.tokens":
            value = [renamed.get(i, token) for i, token in enumerate(value)]
        if isinstance(value, list):
            item = gguf.GGUFValueType.INT32 if isinstance(value[0], int) else gguf.GGUFValueType.STRING
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, item)
        else:
            writer.add_key_value(key, value, kinds[type(value)])


def _gguf_tensors(weights, config, arch: str) -> dict[str, np.ndarray]:
    layer_names = _GEMMA3_LAYER if arch == "gemma3" else _LAYER
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out = {"token_embd.weight": weights["model.embed_tokens.weight"],
           "output_norm.weight": weights["model.norm.weight"]}
    if "lm_head.weight" in weights:
        out["output.weight"] = weights["lm_head.weight"]
    for name, tensor in weights.items():
        parts = name.split(".")
        if parts[:2] != ["model", "layers"]:
            continue
        module, kind = ".".join(parts[3:-1]), parts[-1]
        gguf_name = f"blk.{parts[2]}.{layer_names[module]}.{kind}"
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            tensor = _permute(tensor, heads if module == "self_attn.q_proj" else kv_heads)
        out[gguf_name] = tensor
    if arch == "gemma3":
        out = {k: v + np.float32(1.0) if k.endswith("norm.weight") else v for k, v in out.items()}
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def _permute(weight, heads):
    """llama.cpp's LlamaModel.permute: each head's two halves of rows interleaved."""
    shape = weight.shape
    return (weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:])
            .swapaxes(1, 2).reshape(shape))
