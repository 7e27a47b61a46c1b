"""Float checkpoints in 16 bits on the host: a bf16 safetensors directory and an F16 GGUF file
load with `LLM`, keep every matrix in its 16 bits (cpu/matmul_16bit.c), match the float64
reference on those weights, decode what the float32 copy of the same weights decodes, and give a
sequence the same logprobs alone and in a batch."""
import json
import subprocess
import sys

import numpy as np
import pytest

from ember_cupy import LLM, SamplingParams
from ember_cupy.half_weight import HalfWeight
from ember_cupy.ops import _host
from tiny_gguf import write_tiny_gguf
from tiny_model import assert_greedy_matches_reference, write_tiny_checkpoint

# hidden 48: an inner dimension that is not a multiple of 16 or 32; 2 layers, GQA
SHAPE = dict(heads=4, kv_heads=2, hidden=48, layers=2)
PROMPTS = [[3 + (7 * i + j) % 60 for i in range(9 + j)] for j in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def _bf16_checkpoint(path):
    weights = write_tiny_checkpoint(path, dtype="bfloat16", **SHAPE)
    return weights, json.load(open(path / "config.json"))


def _f16_gguf(tmp_path):
    """The tiny checkpoint as an F16 GGUF; its weights as the file holds them (matrices rounded)."""
    weights = write_tiny_checkpoint(tmp_path / "hf", **SHAPE)
    config = json.load(open(tmp_path / "hf" / "config.json"))
    path = write_tiny_gguf(tmp_path / "model.gguf", weights, config, half_matrices=True)
    rounded = {name: w.astype(np.float16).astype(np.float32) if w.ndim == 2 else w for name, w in weights.items()}
    return path, rounded, config


def _matrices(llm):
    model = llm.engine.runner.model
    return [model.embed, model.lm_head] + [getattr(layer, name) for layer in model.layers
                                           for name in ("qkv", "o", "gate_up", "down")]


def _params(weights) -> int:
    return sum(w.size for w in weights.values() if w.ndim == 2)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    weights, config = _bf16_checkpoint(path)
    return path, weights, config, LLM(str(path), kv_cache_dtype="float32")


def test_bf16_safetensors_are_served_in_16_bits(bf16):
    path, weights, config, llm = bf16
    matrices = _matrices(llm)
    assert all(isinstance(m, HalfWeight) and m.qtype == "BF16" and m.data.dtype == np.uint16 for m in matrices)
    held = {id(m): m.nbytes for m in matrices}       # the tied LM head is the embedding table
    assert sum(held.values()) == 2 * _params(weights)
    if _host.active() is not None:      # one host call a layer (EMBER_HOST_KERNELS=0: the twins)
        assert llm.engine.runner.model._fused_layers(llm.engine.runner.kv_caches) is not None


def test_bf16_logits_match_the_float64_reference(bf16):
    path, weights, config, llm = bf16
    assert_greedy_matches_reference(llm, weights, config)


FAMILIES = {
    "gemma3-sliding-tied": dict(arch="Gemma3ForCausalLM", heads=4, kv_heads=1, head_dim=16, layers=4,
                                sliding_window=5, extra_config={"sliding_window_pattern": 2}),
    "qwen2-biases": dict(arch="Qwen2ForCausalLM", bias=True, heads=4, kv_heads=2, hidden=48),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_in_bf16_match_the_float64_reference(tmp_path, family):
    weights = write_tiny_checkpoint(tmp_path, dtype="bfloat16", **FAMILIES[family])
    llm = LLM(str(tmp_path), kv_cache_dtype="float32", block_size=4, max_num_batched_tokens=7)
    assert all(isinstance(m, HalfWeight) for m in _matrices(llm))
    assert_greedy_matches_reference(llm, weights, json.load(open(tmp_path / "config.json")))


def test_bf16_decodes_what_its_float32_copy_decodes(bf16, tmp_path):
    """The same values stored as float32 go through the float32 path (NumPy's GEMM): the sums
    differ in order only, the greedy tokens do not."""
    path, weights, config, llm = bf16
    write_tiny_checkpoint(tmp_path, dtype="float32", **SHAPE)      # same seed: the unrounded values
    from safetensors.numpy import save_file
    save_file({name: np.ascontiguousarray(w, np.float32) for name, w in weights.items()},
              str(tmp_path / "model.safetensors"))
    fp32 = LLM(str(tmp_path), kv_cache_dtype="float32")
    assert not isinstance(fp32.engine.runner.model.layers[0].qkv, HalfWeight)
    ours = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)]
    theirs = [o.outputs[0] for o in fp32.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    for a, b in zip(ours, theirs):
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-4


def test_a_sequence_has_the_same_logprobs_alone_and_in_a_batch(bf16):
    path, weights, config, llm = bf16
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    alone = llm.generate([PROMPTS[1]], params)[0]
    batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]] * 2, params)[1]
    assert alone.outputs[0].token_ids == batch.outputs[0].token_ids
    assert [e.top for e in alone.outputs[0].logprobs] == [e.top for e in batch.outputs[0].logprobs]
    assert [e and e.top for e in alone.prompt_logprobs] == [e and e.top for e in batch.prompt_logprobs]


def test_f16_gguf_is_served_in_16_bits_and_matches_the_reference(tmp_path):
    path, weights, config = _f16_gguf(tmp_path)
    llm = LLM(path, kv_cache_dtype="float32")
    matrices = _matrices(llm)
    assert all(isinstance(m, HalfWeight) and m.qtype == "F16" for m in matrices)
    assert sum({id(m): m.nbytes for m in matrices}.values()) == 2 * _params(weights)
    assert_greedy_matches_reference(llm, weights, config)


def test_quantization_none_keeps_16_bits(tmp_path):
    """The exact reference mode: the kernel multiplies the checkpoint's exact values in float32."""
    weights, config = _bf16_checkpoint(tmp_path)
    none = LLM(str(tmp_path), quantization="none", kv_cache_dtype="float32")
    assert all(isinstance(m, HalfWeight) for m in _matrices(none))
    assert_greedy_matches_reference(none, weights, config)


def test_a_bf16_checkpoint_loads_in_a_process_that_never_imported_ml_dtypes(bf16):
    """safetensors reads bf16 as NumPy's "bfloat16", a dtype only ml_dtypes registers."""
    path = bf16[0]
    code = (f"from ember_cupy import LLM, SamplingParams; llm = LLM({str(path)!r}); "
            "print(llm.generate([[3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
