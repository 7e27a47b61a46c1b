"""The fused decoder layers (cpu/layer.c: one host-kernel call for every layer of a forward) equal
their twin, the model's op-by-op forward, and the layer-by-layer calls bit for bit: prefill chunks, decodes and mixed batches, both KV cache dtypes, on the
default model (Llama), on Gemma 3 270M (sandwich norms, qk_norm, GELU-tanh, 512-key windows with
their own RoPE base, a prompt past the window) and on tiny models of every family; bad arguments
get a status, not a crash."""
import json
import os

import gguf
import numpy as np
import pytest

from ember_cupy import LLM, SamplingParams
from ember_cupy.model.loader import load_checkpoint
from ember_cupy.ops import _host
from ember_cupy.model import decoder as decoder_module
from ember_cupy.ops.layer import LayerStack, LayerWeightsArgs, StepArgs, decoder_layer, decoder_layers
from gemma3_model import gemma3_gguf_path
from tiny_gguf import write_tiny_gguf
from tiny_model import GEMMA3, assert_greedy_matches_reference, write_tiny_checkpoint

pytestmark = pytest.mark.skipif(_host.active() is None, reason="host kernels unavailable (no C compiler)")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,",
           "1, 2, 3, 4, 5,"]
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=5, ignore_eos=True)


def _generate(llm, prompts, fused: bool):
    model = llm.engine.runner.model
    model.fuse_layers = fused
    outputs = llm.generate(prompts, PARAMS)
    assert (model._fused is not None) == fused   # the path asked for is the path taken
    return outputs


def _assert_same_tokens_and_logprobs(fused_outputs, op_by_op_outputs, atol: float) -> None:
    for a, b in zip(fused_outputs, op_by_op_outputs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs + a.prompt_logprobs[1:], b.outputs[0].logprobs + b.prompt_logprobs[1:],
                        strict=True):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            np.testing.assert_allclose([lp for _, lp in x.top], [lp for _, lp in y.top], atol=atol)


def _fused_against_op_by_op(make, prompts, atol: float = 1e-5) -> None:
    _assert_same_tokens_and_logprobs(_generate(make(), prompts, True), _generate(make(), prompts, False), atol)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "float32"])
def test_fused_layers_give_the_op_by_op_logprobs(make_llm, kv_cache_dtype):
    _fused_against_op_by_op(lambda: make_llm(enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype,
                                             max_num_batched_tokens=16), PROMPTS)


def test_16_bit_matrices_take_the_fused_layer(tmp_path):
    """A bf16 checkpoint (Qwen3: qk_norm; hidden 48, not a multiple of 32): the layers' 16-bit
    matrices run in the fused host call as they do op by op."""
    write_tiny_checkpoint(tmp_path, arch="Qwen3ForCausalLM", dtype="bfloat16", heads=4, kv_heads=2, hidden=48)
    prompts = [[3 + (5 * i + j) % 60 for i in range(7 + 3 * j)] for j in range(3)]
    _fused_against_op_by_op(lambda: LLM(str(tmp_path), kv_cache_dtype="float32", max_num_batched_tokens=8), prompts)


# ---- Gemma 3 270M ---------------------------------------------------------------------------
GEMMA3_FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "gemma3_teacher_forced.json")


@pytest.fixture(scope="module")
def gemma3():
    return load_checkpoint(gemma3_gguf_path())


def _longest_fixture_prompt() -> list[int]:
    prompts = json.load(open(GEMMA3_FIXTURE, encoding="utf-8"))["prompts"]
    return max((p["input_ids"] for p in prompts), key=len)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "float32"])
def test_gemma3_fused_layers_give_the_op_by_op_logprobs(gemma3, kv_cache_dtype):
    """The default path: the file's Q5_0 / Q4_K / Q6_K matrices in their own blocks (half the
    layers' qkv stack Q5_0 q, k with a Q8_0 v)."""
    long_prompt = _longest_fixture_prompt()
    assert len(long_prompt) > gemma3.config.sliding_window + 100   # decodes and chunks past the window
    _fused_against_op_by_op(
        lambda: LLM(gemma3, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=64,
                    max_model_len=1024, kv_cache_memory=64 << 20, enable_prefix_caching=False),
        [long_prompt, *PROMPTS[:2]], atol=1e-4)


# ---- tiny models of every family --------------------------------------------------------------
TINY_GGUF = {   # written as GGUF with Q8_0 matrices, served as stored (quantization auto)
    "llama": dict(heads=4, kv_heads=2),
    "qwen2-qkv-bias": dict(arch="Qwen2ForCausalLM", bias=True, heads=4, kv_heads=2),
    "qwen3-qk-norm": dict(arch="Qwen3ForCausalLM", heads=4, kv_heads=2, head_dim=16),
    "gemma3-sliding-pattern": dict(arch=GEMMA3, heads=4, kv_heads=1, head_dim=16, layers=4, sliding_window=5,
                                   extra_config={"sliding_window_pattern": 2}),
}
TINY_HF = {     # HF checkpoints quantized to Q8_0: a GGUF of arch llama stores no window
    "mistral-all-sliding": dict(arch="MistralForCausalLM", heads=4, kv_heads=1, sliding_window=4),
}
TINY_PROMPTS = [[3 + (7 * i) % 60 for i in range(11)], [5, 9, 13, 17, 21], [3 + (5 * i) % 61 for i in range(17)]]


def _tiny(tmp_path, variant: str):
    """(checkpoint, quantization, weights, config) of a tiny model of the variant."""
    options = {**TINY_GGUF, **TINY_HF}[variant]
    weights = write_tiny_checkpoint(tmp_path / "hf", **options)
    config = json.load(open(tmp_path / "hf" / "config.json"))
    if variant in TINY_HF:
        return load_checkpoint(str(tmp_path / "hf")), "q8_0", weights, config
    path = write_tiny_gguf(tmp_path / "model.gguf", weights, config, quantize_matrices=True)
    return load_checkpoint(path), "auto", weights, config


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "float32"])
@pytest.mark.parametrize("variant", sorted({**TINY_GGUF, **TINY_HF}))
def test_tiny_families_fused_give_the_op_by_op_logprobs(tmp_path, variant, kv_cache_dtype):
    checkpoint, quantization, weights, config = _tiny(tmp_path, variant)
    make = lambda: LLM(checkpoint, quantization=quantization, kv_cache_dtype=kv_cache_dtype,  # noqa: E731
                       block_size=4, max_num_batched_tokens=7, enable_prefix_caching=False)
    _fused_against_op_by_op(make, TINY_PROMPTS)


@pytest.mark.parametrize("variant", sorted({**TINY_GGUF, **TINY_HF}))
@pytest.mark.parametrize("prompt_activations, tolerance", [("int8", 1e-3), ("auto", 3e-2)])
def test_tiny_families_fused_match_the_dense_reference(tmp_path, variant, prompt_activations, tolerance):
    """Against the float64 reference with the matrices it serves (Q8_0-rounded): what remains is
    the activations' int8 quantization, both passes on every block here; with prompt rows in
    bf16 where the machine has AMX-BF16 tiles or AVX512-BF16 (auto), also x and W rounded to 8 bits there."""
    checkpoint, quantization, weights, config = _tiny(tmp_path, variant)
    llm = LLM(checkpoint, quantization=quantization, kv_cache_dtype="float32", second_pass_threshold=0.0,
              block_size=4, max_num_batched_tokens=7, prompt_activations=prompt_activations)
    assert_greedy_matches_reference(llm, _q8_0_rounded(weights), config, tolerance=tolerance)
    assert llm.engine.runner.model._fused is not None


def _q8_0_rounded(weights: dict) -> dict:
    """Every matrix as its Q8_0 blocks dequantize (how both the GGUF writer and quantization
    "q8_0" store them: llama.cpp's rounding along the input axis)."""
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    return {name: gguf.quants.dequantize(gguf.quants.quantize(w, q8_0), q8_0) if w.ndim == 2 else w
            for name, w in weights.items()}


def test_one_call_for_the_stack_gives_the_bits_of_a_call_per_layer(tmp_path, monkeypatch):
    checkpoint, quantization, _, _ = _tiny(tmp_path, sorted(TINY_GGUF)[0])
    make = lambda: LLM(checkpoint, quantization=quantization, block_size=4, max_num_batched_tokens=7,  # noqa: E731
                       enable_prefix_caching=False)
    stacked = _generate(make(), TINY_PROMPTS, True)
    layers_called = []

    def layer_by_layer(library, stack, step, hidden, residual):
        for index, weights in enumerate(stack.layers):
            layers_called.append(index)
            decoder_layer(library, weights, step, hidden, residual, index == 0)

    monkeypatch.setattr(decoder_module, "decoder_layers", layer_by_layer)
    _assert_same_tokens_and_logprobs(stacked, _generate(make(), TINY_PROMPTS, True), atol=0)
    assert layers_called


def test_a_forward_makes_one_host_kernel_call_for_its_layers(make_llm, monkeypatch):
    """A step releases Python's GIL around each host-kernel call and waits for it after: with
    another thread holding it (a 4 MB text's ids, a large JSON answer) each wait lasts up to a switch
    interval plus that thread's C call. So the layers of a forward are one call, not one each."""
    llm = make_llm()
    library = _host.active()
    calls = []
    real_lib = library.lib

    class CountingLibrary:
        def __getattr__(self, name):
            function = getattr(real_lib, name)
            return (lambda *args: calls.append(name) or function(*args)) if name.startswith("ember_") else function

    monkeypatch.setattr(library, "lib", CountingLibrary())
    llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert calls.count("ember_decoder_layers") == 3 and "ember_llama_layer" not in calls, calls
    assert len(calls) <= 3 * 4, calls      # and a few more per step: the final norm, the LM head


# ---- bad arguments ----------------------------------------------------------------------------
def test_bad_layer_arguments_return_a_status():
    """Checked before any array is touched: a norm without its pair (31), an unknown activation
    (32), the Llama layout without a residual (33), a slot outside the pool (30)."""
    library = _host.active()
    slots, floats = np.zeros(1, np.int32), np.zeros((1, 8), np.float32)
    step = lambda **fields: StepArgs(tokens=1, hidden=8, num_blocks=1, block_size=1,  # noqa: E731
                                     slot_mapping=slots.ctypes.data, **fields)
    cases = [(LayerWeightsArgs(q_norm=floats.ctypes.data), step(), floats, 31),
             (LayerWeightsArgs(post_ffn_norm=floats.ctypes.data), step(), floats, 31),
             (LayerWeightsArgs(), step(activation=7), floats, 32),
             (LayerWeightsArgs(), step(), None, 33)]
    for weights, step_arguments, residual, status in cases:
        with pytest.raises(RuntimeError, match=f"status {status}$"):
            decoder_layer(library, weights, step_arguments, floats, residual, True)
    slots[0] = 1
    with pytest.raises(RuntimeError, match="status 30$"):
        decoder_layer(library, LayerWeightsArgs(), step(), floats, floats, True)
    slots[0] = 0
    bad_stack = LayerStack([LayerWeightsArgs(q_norm=floats.ctypes.data), LayerWeightsArgs()])
    with pytest.raises(RuntimeError, match="status 31$"):     # the first layer's, the second not run
        decoder_layers(library, bad_stack, step(), floats, floats)
