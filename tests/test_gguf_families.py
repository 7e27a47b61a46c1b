"""GGUF files of every supported family (Llama, Mistral as llama.cpp writes it, Qwen2, Qwen3,
Gemma 3), written here from tiny random checkpoints the way llama.cpp's converter writes them,
against the float64 dense reference; Llama 3.1+'s `rope_freqs`; unknown architectures and
pre-tokenizers refused by name."""
import json

import numpy as np
import pytest

from ember_cupy import LLM
from ember_cupy.model.loader import load_checkpoint
from ember_cupy.ops import rope_cos_sin_cache
from tiny_gguf import write_tiny_gguf
from tiny_model import assert_greedy_matches_reference, write_tiny_checkpoint

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

VARIANTS = {
    "llama-gqa": dict(heads=4, kv_heads=2),
    "mistral-as-llama": dict(arch="MistralForCausalLM", heads=4, kv_heads=1),
    "qwen2-biases": dict(arch="Qwen2ForCausalLM", bias=True, heads=4, kv_heads=2),
    "qwen3-qk-norm": dict(arch="Qwen3ForCausalLM", heads=4, kv_heads=2, head_dim=16),
    "gemma3-sliding-pattern": dict(arch="Gemma3ForCausalLM", heads=4, kv_heads=1, head_dim=16, layers=4,
                                   sliding_window=5, extra_config={"sliding_window_pattern": 2}),
    "gemma3-linear-rope": dict(arch="Gemma3ForCausalLM", heads=2, kv_heads=2, layers=2, sliding_window=3,
                               rope_scaling={"rope_type": "linear", "factor": 2.0},
                               extra_config={"sliding_window_pattern": 2}),
}


def _tiny(tmp_path, **variant):
    weights = write_tiny_checkpoint(tmp_path / "hf", **variant)
    config = json.load(open(tmp_path / "hf" / "config.json"))
    return weights, config


def _llm(path):
    return LLM(path, quantization="none", block_size=4, max_num_batched_tokens=7, kv_cache_dtype="float32")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gguf_matches_dense_reference(tmp_path, variant):
    weights, config = _tiny(tmp_path, **VARIANTS[variant])
    path = write_tiny_gguf(tmp_path / "model.gguf", weights, config)
    assert_greedy_matches_reference(_llm(path), weights, config)


def test_gguf_q8_0_matrices_on_the_default_path_stay_close(tmp_path):
    """Gemma 3's layout with Q8_0 matrices, served quantized (quantization=auto)."""
    weights, config = _tiny(tmp_path, **VARIANTS["gemma3-sliding-pattern"])
    path = write_tiny_gguf(tmp_path / "model.gguf", weights, config, quantize_matrices=True)
    llm = LLM(path, block_size=4, max_num_batched_tokens=7, kv_cache_dtype="float32")
    assert llm.engine.runner.quantization == "auto"
    assert_greedy_matches_reference(llm, weights, config, tolerance=0.05, max_tokens=4)


def _llama3_divisors(config: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs: default / llama3 inverse frequencies,
    the llama3 ones from transformers' own _compute_llama3_parameters."""
    pytest.importorskip("transformers", reason="the llama3 reference frequencies come from transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import _compute_llama3_parameters
    hf_config = LlamaConfig(hidden_size=config["hidden_size"], num_attention_heads=config["num_attention_heads"],
                            head_dim=head_dim, rope_theta=config["rope_theta"],
                            rope_scaling=dict(config["rope_scaling"]),
                            max_position_embeddings=config["max_position_embeddings"])
    scaled, _ = _compute_llama3_parameters(hf_config, "cpu")
    base = 1.0 / (config["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    return base / scaled.double().numpy(), scaled.double().numpy()


def test_rope_freqs_tensor_is_llama3_scaling(tmp_path):
    """A Llama 3.1-style GGUF: its scaling lives only in rope_freqs; the model's cos/sin cache must
    be transformers' llama3 frequencies, and its logits the reference's with llama3 scaling."""
    weights, config = _tiny(tmp_path, heads=8, kv_heads=1, hidden=64, rope_scaling=LLAMA3_SCALING)
    head_dim = config["head_dim"]
    divisors, llama3_inv_freq = _llama3_divisors(config, head_dim)
    assert (divisors > 1.001).any()    # the tiny config does scale some frequencies
    path = write_tiny_gguf(tmp_path / "model.gguf", weights, config, rope_freqs=divisors)
    llm = _llm(path)
    cache = llm.engine.runner.model.rope.table
    angles = np.arange(len(cache))[:, None] * llama3_inv_freq[None, :]
    np.testing.assert_allclose(cache, np.concatenate([np.cos(angles), np.sin(angles)], -1), atol=1e-5)
    assert_greedy_matches_reference(llm, weights, config)


def test_rope_freqs_apply_at_long_positions():
    """Llama-3.2-1B's parameters: the factors move frequencies by > 0.1 rad at position 2000."""
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = {"hidden_size": 2048, "num_attention_heads": 32, "rope_theta": 500000.0,
              "rope_scaling": scaling, "max_position_embeddings": 131072}
    divisors, llama3_inv_freq = _llama3_divisors(config, 64)
    ours = rope_cos_sin_cache(64, 2001, 500000.0, freq_factors=divisors)[2000]
    unscaled = rope_cos_sin_cache(64, 2001, 500000.0)[2000]
    np.testing.assert_allclose(ours, np.concatenate([np.cos(2000 * llama3_inv_freq), np.sin(2000 * llama3_inv_freq)]),
                               atol=1e-5)
    assert np.abs(ours - unscaled).max() > 0.1


def _tiny_gguf(tmp_path, **options) -> str:
    weights, config = _tiny(tmp_path, heads=4, kv_heads=2)
    return write_tiny_gguf(tmp_path / "model.gguf", weights, config, **options)


def test_unknown_architecture_is_named(tmp_path):
    with pytest.raises(ValueError, match="'falcon'"):
        load_checkpoint(_tiny_gguf(tmp_path, arch_name="falcon"))


@pytest.mark.parametrize("pre", ["jais-2", "made-up-bpe"])
def test_unknown_pre_tokenizer_is_named(tmp_path, pre):
    with pytest.raises(ValueError, match=f"pre-tokenizer '{pre}'"):
        load_checkpoint(_tiny_gguf(tmp_path, pre=pre))


def test_rope_tables_grow_as_positions_need_them(tmp_path, monkeypatch):
    """Tables start short and double as the context grows (global and local RoPE of Gemma 3):
    the output still equals the dense reference past every growth."""
    from ember_cupy.ops import RopeTable
    monkeypatch.setattr(RopeTable, "INITIAL_ROWS", 4)
    weights, config = _tiny(tmp_path, **VARIANTS["gemma3-sliding-pattern"])
    llm = _llm(write_tiny_gguf(tmp_path / "model.gguf", weights, config))
    model = llm.engine.runner.model
    assert len(model.rope.table) == len(model.local_rope.table) == 4
    assert_greedy_matches_reference(llm, weights, config)
    assert len(model.rope.table) == len(model.local_rope.table) == 32   # 23 positions
    assert model.rope.table is not model.local_rope.table


def test_rope_table_rows_match_the_full_table_up_to_the_context_length():
    from ember_cupy.ops import RopeTable
    table = RopeTable(8, 5000, 1e4)
    assert len(table.table) == RopeTable.INITIAL_ROWS
    assert len(table.reserve(4097)) == 5000 and len(table.reserve(9000)) == 5000
    np.testing.assert_array_equal(table.table, rope_cos_sin_cache(8, 5000, 1e4))
