"""A GGUF in another block format than the default model's (here Q5_1, written from it) loads
through the public API with its matrices served in their own blocks, and computes close to the
same file dequantized to fp32."""
import os
import sys

import numpy as np
import pytest

from ember_cupy import LLM, SamplingParams
from ember_cupy.model.loader import default_model_path
from ember_cupy.packed_weight import PackedWeight
from tiny_gguf import write_out

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))


@pytest.fixture(scope="module")
def q5_1_gguf(tmp_path_factory):
    import gguf
    from llamacpp import _copy_field
    src = default_model_path()
    dst = str(tmp_path_factory.mktemp("gguf") / "smollm2-q5_1.gguf")
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name not in ("general.architecture", "general.file_type"):
            _copy_field(writer, name, field)
    for tensor in reader.tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            data = gguf.quants.quantize(values.reshape(int(tensor.shape[1]), -1), gguf.GGMLQuantizationType.Q5_1)
            writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType.Q5_1)
        else:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    write_out(writer)
    return dst


def test_q5_1_matrices_are_served_as_q5_1_and_agree_with_fp32(q5_1_gguf):
    prompt = "The quick brown fox jumps over the lazy dog. Then it ran into the forest, where"
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    quantized = LLM(q5_1_gguf)
    layer = quantized.engine.runner.model.layers[0]
    assert all(isinstance(m, PackedWeight) and m.qtype == "Q5_1" for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    ours = quantized.generate(prompt, params)[0].prompt_logprobs
    reference = LLM(q5_1_gguf, quantization="none").generate(prompt, params)[0].prompt_logprobs
    agree = [o.top[0][0] == r.top[0][0] for o, r in zip(ours[1:], reference[1:])]
    assert np.mean(agree) >= 0.9
    gaps = [abs(o.top[0][1] - r.top[0][1]) for o, r in zip(ours[1:], reference[1:]) if o.top[0][0] == r.top[0][0]]
    assert max(gaps) < 0.3
