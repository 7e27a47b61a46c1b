"""The fused decoder layer (cpu/layer.c, one host-kernel call per layer) equals its twin, the
model's op-by-op forward, on the real model: prefill chunks, decodes and preemption-free batches."""
import numpy as np
import pytest

from ember_cupy import SamplingParams
from ember_cupy.ops import _host

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,",
           "1, 2, 3, 4, 5,"]


@pytest.mark.skipif(_host.active() is None, reason="host kernels unavailable (no C compiler)")
@pytest.mark.parametrize("kv_cache_dtype", ["float16", "float32"])
def test_fused_layers_give_the_op_by_op_logprobs(make_llm, kv_cache_dtype):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    results = {}
    for fused in (True, False):
        llm = make_llm(enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=16)
        llm.engine.runner.model.fuse_layers = fused
        outputs = llm.generate(PROMPTS, params)
        assert (getattr(llm.engine.runner.model, "_fused", None) is not None) == fused
        results[fused] = outputs
    for a, b in zip(results[True], results[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs + a.prompt_logprobs[1:], b.outputs[0].logprobs + b.prompt_logprobs[1:]):
            np.testing.assert_allclose([lp for _, lp in x.top], [lp for _, lp in y.top], atol=1e-5)
