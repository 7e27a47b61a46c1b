"""The quantized CuPy path end to end on the CPU: the stand-in cupy (tests/kernels/shim/standin_cupy.py)
serves the real default model (SmolLM2-135M, Q4_1 matrices, Q8_0 tied embedding / LM head) in its
GGUF blocks on the 'device', through cuda/matmul_q.cu on the CPU shim (GEMV for decode and short
prefill chunks, dequantized slices + matmul for long ones; embedding rows dequantized by kernel),
and must give the greedy tokens of the NumPy backend serving the same weights dequantized
(quantization="none": weight-only quantization computes x @ W with W's exact values)."""
from __future__ import annotations

import numpy as np
import pytest

from ember_cupy import LLM, SamplingParams
from ember_cupy.model.loader import default_model_path
from ember_cupy.quant import DEVICE_FORMATS, DeviceQuantizedWeight

from kernels.shim import standin_cupy

# the first prompt is prefilled in one chunk of more than GEMV_MAX_ROWS (8) tokens
PROMPTS = ["Once upon a time, in a land far away, there lived a king who had three daughters and",
           "The capital of France is", "def fib(n):"]
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
CONFIG = dict(max_num_batched_tokens=32, block_size=16, num_kv_blocks=16, dtype="float32")


def greedy(llm) -> list[list[int]]:
    """The prompts as one batch (3-row decode steps), then the second alone (1-row steps)."""
    batch = [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, PARAMS)]
    return batch + [list(llm.generate(PROMPTS[1], PARAMS)[0].outputs[0].token_ids)]


@pytest.fixture(scope="module")
def numpy_tokens(checkpoint):
    return greedy(LLM(checkpoint, quantization="none", **CONFIG))


@pytest.fixture(scope="module")
def standin_run():
    """Tokens, the LLM, and the names of the kernels launched, on the stand-in cupy."""
    launched = set()
    call = standin_cupy.RawKernel.__call__

    def recording(self, grid, block, args, **kwargs):
        launched.add(self.name)
        return call(self, grid, block, args, **kwargs)
    with pytest.MonkeyPatch.context() as patch, standin_cupy.installed() as cupy:
        patch.setattr(standin_cupy.RawKernel, "__call__", recording)
        llm = LLM(default_model_path(), quantization="auto", **CONFIG)
        launched.clear()   # the requests' kernels, not the start-up check's
        yield greedy(llm), llm, launched, cupy


def test_quantized_device_path_gives_the_numpy_backends_tokens(standin_run, numpy_tokens):
    tokens, _, launched, _ = standin_run
    assert tokens == numpy_tokens
    # decode and short chunks: the Q4_1 GEMV (1 and 4 rows a read) and the Q8_0 LM head into f32
    # logits; the long chunk: dequantized slices; the embedding rows: dequantized on the device
    assert {"matmul_q_q4_1_r1_f32", "matmul_q_q4_1_r4_f32", "matmul_q_q8_0_r1_f32",
            "dequantize_range_q4_1_f32", "dequantize_rows_q8_0_f32"} <= launched


def test_the_device_holds_the_gguf_blocks(standin_run, checkpoint):
    _, llm, _, cupy = standin_run
    model = llm.engine.runner.model
    assert llm.engine.runner.quantization == "auto"
    matrices = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert {m.qtype for m in matrices} == {"Q4_1"} and model.embed.qtype == "Q8_0"
    assert model.lm_head is model.embed                       # tied, held once
    for weight in [*matrices, model.embed]:
        assert isinstance(weight, DeviceQuantizedWeight)
        for array in (weight.quants, weight.scales):
            assert isinstance(array, cupy.ndarray) and not isinstance(array, np.ndarray)
    # the bytes of the GGUF's tensors (the loader's, not consumed), a fifth of them in float32
    stored = checkpoint.weights.values()
    gguf_bytes = sum(int(w.nbytes) for w in stored)
    fp32_bytes = 4 * sum(int(np.prod(w.shape)) for w in stored)
    assert abs(model.weight_bytes() - gguf_bytes) <= 0.01 * gguf_bytes
    assert model.weight_bytes() < fp32_bytes / 5
    assert not llm.engine.checkpoint.weights      # consumed: no host copy left behind


@pytest.mark.parametrize("quantization, qtype, served", [
    ("auto", "Q4_1", "Q4_1"), ("auto", "Q4_0", "Q4_0"), ("auto", "Q8_0", "Q8_0"),
    ("auto", "Q5_0", "float"),          # no CUDA kernel: dequantized, as before
    ("q8_0", "Q5_0", "Q8_0"), ("none", "Q4_1", "float")])
def test_serving_format_on_the_device(quantization, qtype, served):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from ember_cupy.model.weights import linear_weight
    from ember_cupy.quant import QuantizedTensor
    weight = np.random.default_rng(0).standard_normal((8, 64), dtype=np.float32)
    tensor = QuantizedTensor(qtype, quantize(weight, GGMLQuantizationType[qtype]), (8, 64))
    with standin_cupy.installed() as cupy:
        put = lambda array: cupy.asarray(np.ascontiguousarray(array, dtype=np.float32))  # noqa: E731
        got = linear_weight(tensor, quantization, put, cupy)
        if served == "float":
            assert isinstance(got, cupy.ndarray) and got.shape == (64, 8)      # [in, out]
            np.testing.assert_array_equal(got.get(), tensor.dequantize().T)
        else:
            assert isinstance(got, DeviceQuantizedWeight) and got.qtype == served
            assert isinstance(got.quants, cupy.ndarray)
            assert got.nbytes == 8 * (64 // 32) * DEVICE_FORMATS[served]     # the GGUF blocks' bytes
