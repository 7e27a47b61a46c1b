"""Deterministic mode on the device path (EngineConfig.deterministic, `--deterministic`), run on the
CPU by the stand-in cupy (tests/kernels/shim/standin_cupy.py: real NVRTC, the kernels' float
operations in their order on the CPU shim): the real model's first 2 blocks in their GGUF blocks
(Q4_1 matrices, Q8_0 tied LM head) give a prompt the same token ids and logprobs, bit for bit,
computed cold, after a prefix-cache hit that leaves one prompt token to compute (a decode-kernel
row instead of a prefill-kernel row, a 1-row matmul instead of a 33-row one) and in a batch."""
from __future__ import annotations

import sys

import pytest

from ember_cupy import LLM, SamplingParams
from ember_cupy.model.loader import default_model_path
from ember_cupy.ops import _cuda

from kernels.shim import standin_cupy

TEXT = ("The old lighthouse keeper climbed the stairs every evening, counting the steps as his father "
        "had taught him, and wondered whether the ships still needed the light at all.")
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=0.9, seed=11, max_tokens=4, ignore_eos=True, logprobs=5)
BLOCK = 4


@pytest.fixture(scope="module")
def cut_model(tmp_path_factory):
    """The default GGUF's first 2 blocks, bit-identical (tools/cut_gguf.py)."""
    sys.path.insert(0, str(_cuda.CUDA_SOURCE_DIR.parent / "tools"))
    from cut_gguf import cut_gguf
    path = tmp_path_factory.mktemp("cut") / "cut2.gguf"
    cut_gguf(default_model_path(), str(path), 2)
    return str(path)


def _completion(output):
    completion = output.outputs[0]
    return list(completion.token_ids), [(e.token_id, e.logprob, e.top) for e in completion.logprobs]


def runs(model: str, deterministic: bool):
    """(cold, after a prefix-cache hit, in a batch of 3) for the greedy and the seeded request."""
    with standin_cupy.installed():
        llm = LLM(model, deterministic=deterministic, dtype="float32", block_size=BLOCK, num_kv_blocks=64,
                  max_num_batched_tokens=64)
        ids = llm.tokenizer.encode(TEXT)
        length = (len(ids) - 2) // BLOCK * BLOCK - BLOCK + 1   # whole blocks + 1: a hit leaves one token
        others = [ids[3:20], ids[7:12]]
        results = []
        for start, params in enumerate((PARAMS, SEEDED)):   # another prompt each: cold again
            prompt = ids[start:start + length]
            cold = _completion(llm.generate([prompt], params)[0])
            hit = _completion(llm.generate([prompt], params)[0])
            batch = _completion(llm.generate([others[0], prompt, others[1]], params)[1])
            results.append((cold, hit, batch))
        return results


def test_deterministic_mode_gives_the_same_bits_cold_after_a_cache_hit_and_in_a_batch(cut_model):
    for cold, hit, batch in runs(cut_model, deterministic=True):
        assert hit == cold
        assert batch == cold
