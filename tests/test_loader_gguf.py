"""GGUF loading: the default model's facts, dequantization, and the q/k row permutation."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from ember_cupy import ops
from ember_cupy.model.gguf_loader import _unpermute_qk
from ember_cupy.model.loader import load_checkpoint


def test_default_model_facts(checkpoint):
    from ember_cupy.model.loader import describe_model
    cfg = checkpoint.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.rope_theta == 1e5 and abs(cfg.rms_norm_eps - 1e-5) < 1e-9
    assert cfg.vocab_size == 49152 and cfg.intermediate_size == 1536
    assert cfg.tie_word_embeddings and "lm_head" not in checkpoint.weights
    assert not cfg.add_bos_token
    facts = checkpoint.facts
    assert (facts.architecture, facts.file_type, facts.num_parameters) == ("llama", "Q4_1", 134515008)  # 134.52M
    assert describe_model(checkpoint.source) == facts
    tok = checkpoint.tokenizer
    assert {tok.id_to_token(i) for i in cfg.eos_token_ids} == {"<|im_end|>", "<|endoftext|>"}


def test_tensors_keep_their_file_format_with_the_model_shape(checkpoint):
    """Quantized matrices stay in their GGUF blocks, [out, in]; norms are float32."""
    cfg = checkpoint.config
    w = checkpoint.weights
    assert (w["embed"].qtype, w["embed"].shape) == ("Q8_0", (cfg.vocab_size, cfg.hidden_size))
    assert w["layers.0.qkv"].shape == (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)   # [out, in]
    assert w["layers.3.gate_up"].shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert w["layers.3.down"].shape == (cfg.hidden_size, cfg.intermediate_size)
    matrices = [v for k, v in w.items() if k.rsplit(".", 1)[-1] in ("qkv", "o", "gate_up", "down")]
    assert {p.qtype for m in matrices for p in getattr(m, "parts", (m,))} == {"Q4_1"}   # fused: a stack of parts
    assert all(w[f"layers.{i}.attn_norm"].dtype == np.float32 for i in range(cfg.num_layers))
    assert all(np.isfinite(m.dequantize()).all() for m in matrices[:8])
    assert len(w) == 2 + 6 * cfg.num_layers   # the q/k/v and gate/up parts are fused, not kept


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.F16])
def test_dequantize_round_trip(qtype):
    """Our reader path (gguf.quants) must reproduce quantize() within the format's error."""
    from ember_cupy.model.gguf_loader import _dequantize

    rng = np.random.default_rng(0)
    data = rng.standard_normal((8, 64)).astype(np.float32)
    raw = quantize(data, qtype)

    class FakeTensor:
        name, tensor_type, shape = "t", qtype, np.array([64, 8])

    FakeTensor.data = raw
    restored = _dequantize(FakeTensor)
    assert restored.shape == data.shape
    tolerance = {QT.F16: 1e-3, QT.Q8_0: 0.03, QT.Q4_1: 0.25, QT.Q4_0: 0.35}[qtype]
    assert np.abs(restored - data).max() < tolerance
    np.testing.assert_array_equal(restored, dequantize(raw, qtype).reshape(8, 64))


def _permute_like_llama_cpp(w, heads):
    """What llama.cpp's converter does to HF q/k rows (written independently of the loader)."""
    rows = w.shape[0]
    out = np.empty_like(w)
    half = rows // heads // 2
    for h in range(heads):
        block = w[h * 2 * half:(h + 1) * 2 * half]
        out[h * 2 * half:(h + 1) * 2 * half][0::2] = block[:half]
        out[h * 2 * half:(h + 1) * 2 * half][1::2] = block[half:]
    return out


def test_unpermute_inverts_the_converter(checkpoint):
    rng = np.random.default_rng(1)
    hf_q = rng.standard_normal((checkpoint.config.q_size, 5)).astype(np.float32)
    restored = _unpermute_qk("layers.0.q", _permute_like_llama_cpp(hf_q, 9), checkpoint.config)
    np.testing.assert_array_equal(restored, hf_q)


@pytest.mark.parametrize("position", [0, 1, 7, 100, 4095])
def test_adjacent_rope_on_gguf_rows_equals_neox_rope_on_unpermuted_rows(checkpoint, position):
    """Both consistent layouts agree at every position; a mixed one agrees only at 0."""
    cfg = checkpoint.config
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)
    hf_q = checkpoint.weights["layers.5.qkv"].dequantize()[:cfg.q_size]
    gguf_q = _permute_like_llama_cpp(hf_q, cfg.num_heads)
    cache = ops.rope_cos_sin_cache(cfg.head_dim, 4096 + 1, cfg.rope_theta)
    pos = np.array([position], dtype=np.int32)

    def rotated(weight, is_neox):
        q = (x @ weight.T).reshape(1, cfg.num_heads, cfg.head_dim)
        k = q[:, :1].copy()
        ops.apply_rope(q, k, pos, cache, is_neox=is_neox)
        return q

    neox = rotated(hf_q, True)
    adjacent = rotated(gguf_q, False)
    mixed = rotated(gguf_q, True)
    # adjacent pairs (2i, 2i+1) in gguf order are pairs (i, i+D/2) in HF order
    np.testing.assert_allclose(_permute_like_llama_cpp(neox.reshape(-1, 1), cfg.num_heads).ravel(),
                               adjacent.ravel(), rtol=1e-5, atol=1e-5)
    if position:
        assert not np.allclose(mixed.ravel(), _permute_like_llama_cpp(neox.reshape(-1, 1), cfg.num_heads).ravel(),
                               atol=1e-3)


def test_missing_and_unsupported_files_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
        load_checkpoint(str(tmp_path / "nowhere.gguf"))
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin"):
        load_checkpoint(str(bad))


def test_the_file_is_not_kept_mapped_once_loaded():
    """Nothing the model keeps may be a view into the GGUF's mmap: the whole file's pages would
    stay resident (~100 MB of RSS for the default model). (A Checkpoint this module's fixture
    holds maps the file too: the LLM must add no mapping of its own.)"""
    import gc

    from ember_cupy import LLM
    from ember_cupy.model.loader import default_model_path

    def mappings() -> int:
        gc.collect()
        with open("/proc/self/maps") as maps:
            return maps.read().count(default_model_path())

    before = mappings()
    llm = LLM(num_kv_blocks=64)
    assert mappings() == before
    assert llm.engine.runner.model.weight_bytes() < 110e6


def test_load_tokenizer_reads_no_weights_and_equals_the_checkpoints(checkpoint):
    from ember_cupy.model.loader import load_tokenizer
    alone, full = load_tokenizer(checkpoint.source), checkpoint.tokenizer
    text = "Hello, world! 🚀 1234"
    assert alone.encode(text) == full.encode(text)
    assert (alone.bos_token_id, alone.eos_token_ids) == (full.bos_token_id, full.eos_token_ids)
