"""HF directories: tiny random checkpoints written here load, run, and match a dense reference."""
import json

import numpy as np
import pytest

from ember_cupy import LLM, SamplingParams
from ember_cupy.engine_client import model_info_of
from ember_cupy.model.checkpoint import ModelFacts
from ember_cupy.model.loader import describe_model
from tiny_model import VOCAB, assert_greedy_matches_reference, reference_logits, write_tiny_checkpoint

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

VARIANTS = {
    "llama-gqa-bf16-sharded": dict(dtype="bfloat16", heads=4, kv_heads=2, shards=3),
    "llama-mha-tied-linear-rope": dict(heads=4, kv_heads=4, tie=True,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama3-rope-gqa8": dict(heads=8, kv_heads=1, hidden=64, rope_scaling=LLAMA3_SCALING),
    "qwen2-biases": dict(arch="Qwen2ForCausalLM", bias=True, heads=4, kv_heads=2),
    "mistral": dict(arch="MistralForCausalLM", heads=4, kv_heads=2),
    "mistral-sliding-window": dict(arch="MistralForCausalLM", heads=4, kv_heads=2, sliding_window=5),
    "qwen3-qk-norm-wide-heads": dict(arch="Qwen3ForCausalLM", heads=4, kv_heads=2, head_dim=16),
    "qwen2-sliding-from-layer-1": dict(arch="Qwen2ForCausalLM", bias=True, layers=3, sliding_window=4,
                                       extra_config={"use_sliding_window": True, "max_window_layers": 1}),
    "gemma3-pattern": dict(arch="Gemma3ForCausalLM", heads=4, kv_heads=1, head_dim=16, layers=4,
                           sliding_window=5, extra_config={"sliding_window_pattern": 2}),
    "gemma3-layer-types-linear-rope": dict(
        arch="Gemma3ForCausalLM", heads=2, kv_heads=2, layers=3, sliding_window=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_checkpoint_matches_dense_reference(tmp_path, variant):
    weights = write_tiny_checkpoint(tmp_path, **VARIANTS[variant])
    config = json.load(open(tmp_path / "config.json"))
    # float32 KV: this holds the model arithmetic to 2e-4 (an f16 cache alone moves logprobs ~4e-4)
    llm = LLM(str(tmp_path), block_size=4, max_num_batched_tokens=7, kv_cache_dtype="float32")
    assert_greedy_matches_reference(llm, weights, config)


def test_tokenizer_and_chat_template_come_from_the_directory(tmp_path):
    write_tiny_checkpoint(tmp_path)
    llm = LLM(str(tmp_path))
    assert llm.tokenizer.encode("w1 w2") == [VOCAB.index("w1"), VOCAB.index("w2")]
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "w5"}]) == "<user>w5"
    assert llm.engine.model_config.eos_token_ids == (1,)


@pytest.mark.parametrize("dtype,file_type", [("float32", "F32"), ("bfloat16", "BF16")])
def test_the_checkpoint_says_what_the_files_hold(tmp_path, dtype, file_type):
    weights = write_tiny_checkpoint(tmp_path, dtype=dtype, shards=2)
    info = model_info_of(LLM(str(tmp_path)).engine)
    assert (info.file_type, info.architecture, info.source) == (file_type, "llama", str(tmp_path))
    assert info.num_parameters == sum(int(np.prod(w.shape)) for w in weights.values())
    assert describe_model(str(tmp_path)) == ModelFacts("llama", file_type, info.num_parameters)


def test_unsupported_architecture_is_named(tmp_path):
    write_tiny_checkpoint(tmp_path)
    config = json.load(open(tmp_path / "config.json"))
    config["architectures"] = ["GPT2LMHeadModel"]
    json.dump(config, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model-00002-of-00002.safetensors"])
def test_missing_file_is_named(tmp_path, missing):
    write_tiny_checkpoint(tmp_path, shards=2)
    (tmp_path / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing.split(".")[0]):
        LLM(str(tmp_path))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float_checkpoint_served_as_q8_0_stays_close_to_the_reference(tmp_path, dtype):
    """--quantization q8_0 quantizes a float checkpoint at load: every matrix becomes Q8_0 blocks
    and the logprobs stay within quantization error of the dense float64 reference."""
    from ember_cupy.packed_weight import PackedWeight
    weights = write_tiny_checkpoint(tmp_path, dtype=dtype, heads=4, kv_heads=2)
    config = json.load(open(tmp_path / "config.json"))
    llm = LLM(str(tmp_path), quantization="q8_0")
    model = llm.engine.runner.model
    matrices = [model.lm_head] + [getattr(layer, f) for layer in model.layers for f in ("qkv", "o", "gate_up", "down")]
    assert all(isinstance(m, PackedWeight) and m.qtype == "Q8_0" for m in matrices)
    prompt = [3 + (7 * i) % 60 for i in range(16)]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=5))[0]
    ref = reference_logits(weights, config, prompt)
    worst = 0.0
    for position in range(1, len(prompt)):
        row = ref[position - 1]
        ref_logprobs = row - row.max() - np.log(np.exp(row - row.max()).sum())
        for token, logprob in out.prompt_logprobs[position].top:
            worst = max(worst, abs(logprob - ref_logprobs[token]))
    assert worst < 0.1, worst          # int8 activations + int8 weights on a random 32-wide model
    none = LLM(str(tmp_path), quantization="none").generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=5))[0]
    assert none.prompt_logprobs[5].top != out.prompt_logprobs[5].top   # quantized for real
