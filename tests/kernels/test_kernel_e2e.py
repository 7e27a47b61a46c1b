"""The real model (SmolLM2-135M Q4_1) with every fused op dispatched to its CUDA kernel through the
CPU shim while GEMMs stay NumPy: greedy tokens equal the NumPy backend's, logits agree in fp32."""
from __future__ import annotations

import contextlib

import numpy as np

from ember_cupy import SamplingParams
from ember_cupy.config import EngineConfig
from ember_cupy.engine.llm_engine import LLMEngine
from ember_cupy.ops import _cuda

from .helpers import PROVIDER

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest was",
    "def fib(n):",
]
BLOCK_SIZE = 16
KERNELS = {"rms_norm_f32", "fused_add_rms_norm_f32", "silu_and_mul_f32", "rotary_f32", "write_kv_f32",
           "paged_attention_decode_d64_f32", "paged_attention_prefill_d64_f32"}


class _Recorder:
    """Wraps a provider, noting which kernels were asked for."""

    def __init__(self, provider):
        self.provider, self.names = provider, set()

    def function(self, source, name):
        self.names.add(name)
        return self.provider.function(source, name)


def generate(checkpoint, provider=None):
    # as the CuPy backend serves it: fp32 matrices (quantized activations would turn the kernels'
    # last-bit differences into int8 rounding flips) and the KV cache in the activations' dtype
    engine = LLMEngine(checkpoint, EngineConfig(max_num_batched_tokens=16, num_kv_blocks=32,
                                                block_size=BLOCK_SIZE, kv_cache_dtype="float32",
                                                quantization="none"))
    logits, chunks = [], []
    execute = engine.runner.execute

    def recording_execute(batch):
        chunks.extend((seq.request_id, n) for seq, n in batch.scheduled)
        step = execute(batch)
        logits.append(np.array(step.sampling_logits))
        return step

    engine.runner.execute = recording_execute
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), prompt, params)
    tokens = {}
    with _cuda.use_provider(provider) if provider else contextlib.nullcontext():
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    tokens[output.request_id] = output.outputs[0].token_ids
    return tokens, logits, chunks, engine


def test_kernels_through_shim_match_numpy_backend(checkpoint):
    want_tokens, want_logits, chunks, engine = generate(checkpoint)
    long_prompt = len(engine.tokenizer.encode(PROMPTS[1]))
    assert long_prompt > BLOCK_SIZE
    assert any(rid == "1" and 1 < n < long_prompt for rid, n in chunks), "long prompt must be chunked"

    recorder = _Recorder(PROVIDER)
    got_tokens, got_logits, _, _ = generate(checkpoint, recorder)
    assert KERNELS <= recorder.names
    assert got_tokens == want_tokens
    assert len(got_logits) == len(want_logits)
    for got, want in zip(got_logits, want_logits):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
