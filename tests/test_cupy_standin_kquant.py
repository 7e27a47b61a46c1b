"""K-quants on the device, end to end on the CPU: the stand-in cupy serves the Gemma 3 270M Q4_K_M
file (its attn_output Q4_K, ffn_down Q4_K / Q6_K matrices in their GGUF blocks through
cuda/matmul_q.cu's K-quant kernels on the CPU shim; its Q5_0 q/k/v and gate/up, which have no
device kernel, dequantized) and must give the greedy tokens of the NumPy backend serving the same
weights dequantized. And a q/k/v stack of Q4_K, Q6_K and Q8_0 parts is served as a DeviceStack."""
from __future__ import annotations

import numpy as np
import pytest

from ember_cupy import LLM, SamplingParams
from ember_cupy.quant import DeviceQuantizedWeight, DeviceStack, QuantizedStack

from gemma3_model import gemma3_gguf_path
from kernels.shim import standin_cupy
from kernels.test_kernel_matmul_q_k import k_quant_weight

# the second prompt is prefilled in one chunk of more than GEMV_MAX_ROWS (8) tokens
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived"]
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
CONFIG = dict(max_num_batched_tokens=32, block_size=16, num_kv_blocks=16, dtype="float32")


def greedy(llm) -> list[list[int]]:
    """The prompts as one batch (2-row decode steps), then the first alone (1-row steps)."""
    batch = [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, PARAMS)]
    return batch + [list(llm.generate(PROMPTS[0], PARAMS)[0].outputs[0].token_ids)]


def test_a_q4_k_m_model_on_the_device_gives_the_numpy_backends_tokens():
    path = gemma3_gguf_path()
    want = greedy(LLM(path, quantization="none", **CONFIG))
    launched = set()
    call = standin_cupy.RawKernel.__call__

    def recording(self, grid, block, args, **kwargs):
        launched.add(self.name)
        return call(self, grid, block, args, **kwargs)
    with pytest.MonkeyPatch.context() as patch, standin_cupy.installed():
        patch.setattr(standin_cupy.RawKernel, "__call__", recording)
        llm = LLM(path, quantization="auto", **CONFIG)
        launched.clear()
        assert greedy(llm) == want
    layers = llm.engine.runner.model.layers
    assert all(isinstance(layer.o, DeviceQuantizedWeight) and layer.o.qtype == "Q4_K" for layer in layers)
    assert {layer.down.qtype for layer in layers} == {"Q4_K", "Q6_K"}
    assert {"matmul_q_q4_k_r1_f32", "matmul_q_q4_k_r4_f32", "matmul_q_q6_k_r1_f32", "matmul_q_q6_k_r4_f32",
            "dequantize_range_q4_k_f32", "dequantize_range_q6_k_f32"} <= launched


def _stack(qtypes):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from ember_cupy.quant import QuantizedTensor
    rng = np.random.default_rng(3)
    parts = []
    for qtype, rows in zip(qtypes, (16, 8, 8)):
        if qtype.endswith("_K"):
            parts.append(k_quant_weight(rng, qtype, rows, 256)[0])
        else:
            weight = rng.standard_normal((rows, 256), dtype=np.float32) * 0.01
            parts.append(QuantizedTensor(qtype, quantize(weight, GGMLQuantizationType[qtype]), (rows, 256)))
    return QuantizedStack(tuple(parts))


def test_a_stack_of_device_formats_is_served_part_by_part():
    from ember_cupy.model.weights import linear_weight
    from ember_cupy.ops.linear import linear
    stack = _stack(("Q4_K", "Q6_K", "Q8_0"))
    x = np.random.default_rng(4).standard_normal((3, 256), dtype=np.float32)
    with standin_cupy.installed() as cupy:
        put = lambda array: cupy.asarray(np.ascontiguousarray(array, dtype=np.float32))  # noqa: E731
        weight = linear_weight(stack, "auto", put, cupy)
        assert isinstance(weight, DeviceStack) and [p.qtype for p in weight.parts] == ["Q4_K", "Q6_K", "Q8_0"]
        assert weight.shape == (32, 256) and weight.nbytes == sum(p.nbytes for p in stack.parts)
        got = linear(cupy.asarray(x), weight).get()
        # a part with no device kernel: the whole stack as floats, as before
        assert isinstance(linear_weight(_stack(("Q4_K", "Q5_0", "Q8_0")), "auto", put, cupy), cupy.ndarray)
    want = x @ stack.dequantize().T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
