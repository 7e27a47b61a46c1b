"""Gemma 3 270M (the optional PyPI GGUF, Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors) through
the public API against an independent float32 reference (tests/fixtures/gemma3_teacher_forced.json,
made by tools/make_gemma3_reference.py with transformers; ids from llama.cpp): teacher forced at
every position of 5 prompts + 16 greedy tokens each, one of them longer than the 512-token
sliding window. Scoring (top-1 agreement, KL(ref || ours) from top-K lists) as in
test_quantized_fidelity.py. Skipped, naming the packages, when the Gemma file is not installed."""
import json
import os

import numpy as np
import pytest

from ember_cupy import LLM, SamplingParams
from ember_cupy.model.loader import load_checkpoint
from gemma3_model import gemma3_gguf_path
from test_quantized_fidelity import K_OURS, score

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "gemma3_teacher_forced.json")
REFERENCE = json.load(open(FIXTURE, encoding="utf-8"))
PROMPTS = {p["name"]: p for p in REFERENCE["prompts"]}
WINDOW = 512
# The default (quantized) path, per prompt. With its Q5_0 / Q4_K / Q6_K matrices served in their
# own blocks the worst position's KL is 2.9e-3 (top-1 99.2% over the 949 positions); requantized
# to Q8_0, as they were before, it was 1.2e-2 (99.05%): 0.01 holds the native kernels to that gain.
MIN_AGREEMENT, MAX_KL = 0.95, 0.01
NONE_MIN_AGREEMENT, NONE_MAX_LOGPROB_ERROR = 0.99, 1e-3   # quantization="none": fp32 throughout


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(gemma3_gguf_path())


def test_the_file_is_what_the_model_code_expects(checkpoint):
    cfg = checkpoint.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.head_dim) == ("gemma3", 18, 640, 256)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.sliding_window) == (4, 1, WINDOW)
    assert [i for i, s in enumerate(cfg.sliding_layers) if not s] == [5, 11, 17]   # llama.cpp's pattern 6
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh"
    parts = [p for w in checkpoint.weights.values() for p in getattr(w, "parts", (w,))]   # fused q/k/v, gate/up
    assert {p.qtype for p in parts if hasattr(p, "qtype")} >= {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}


def test_reference_covers_the_sliding_window():
    assert max(len(p["input_ids"]) for p in PROMPTS.values()) > WINDOW + 100
    assert sum(len(p["input_ids"]) for p in PROMPTS.values()) >= 900


def _teacher_forced(llm) -> dict:
    names = sorted(PROMPTS)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=K_OURS, prompt_logprobs=K_OURS)
    outputs = llm.generate([PROMPTS[n]["input_ids"] for n in names], params)
    return {name: (score(PROMPTS[name], out), out) for name, out in zip(names, outputs)}


@pytest.fixture(scope="module")
def quantized(checkpoint):
    llm = LLM(checkpoint, max_num_batched_tokens=256, max_model_len=2048, kv_cache_memory=256 << 20)
    assert llm.engine.runner.quantization == "auto"
    return _teacher_forced(llm)


@pytest.fixture(scope="module")
def exact(checkpoint):
    llm = LLM(checkpoint, quantization="none", max_num_batched_tokens=256, max_model_len=2048,
              kv_cache_memory=256 << 20)
    return _teacher_forced(llm)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_default_quantized_path_agrees_with_the_reference(quantized, name):
    stats, _ = quantized[name]
    print(f"{name}: {stats.positions} positions, top-1 {stats.agreement:.4f}, KL mean {stats.mean_kl:.5f} "
          f"max {stats.max_kl:.5f}")
    assert stats.agreement >= MIN_AGREEMENT
    assert stats.max_kl <= MAX_KL   # at every position


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_fp32_path_matches_the_reference(exact, name):
    stats, out = exact[name]
    prompt = PROMPTS[name]
    worst = 0.0
    for p in range(stats.positions - 1):
        ours = dict(out.prompt_logprobs[p + 1].top)
        ref = dict(zip(prompt["top_ids"][p][:5], prompt["top_logprobs"][p][:5]))
        worst = max(worst, max(abs(ours.get(t, -np.inf) - lp) for t, lp in ref.items()))   # missing: inf
    print(f"{name}: top-1 {stats.agreement:.4f}, KL max {stats.max_kl:.2e}, max |dlogprob| top-5 {worst:.2e}")
    assert stats.agreement >= NONE_MIN_AGREEMENT
    assert worst <= NONE_MAX_LOGPROB_ERROR


def test_greedy_completion_from_text(checkpoint):
    """A base model: plain completion of text, tokenized here (BOS added once)."""
    prompt = PROMPTS["english"]
    llm = LLM(checkpoint, max_model_len=512, kv_cache_memory=64 << 20)
    text = "The quick brown fox jumps over the lazy dog. Once upon a time, in a quiet village by the sea, " \
           "there lived an old fisherman who"
    out = llm.generate(text, SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt_token_ids == prompt["input_ids"][:prompt["n_prompt"]]
    assert out.outputs[0].token_ids == prompt["input_ids"][prompt["n_prompt"]:prompt["n_prompt"] + 4]
    assert np.isfinite([e.logprob for e in out.outputs[0].logprobs or []]).all()


def test_a_server_builds_a_large_vocabularys_grammar_tokenizer_at_the_first_constrained_request(checkpoint):
    """llguidance's tokenizer of 262k tokens costs ~2.3 s holding the GIL and ~475 MB: not at
    start (a server that never constrains output pays neither), but for the first request that
    constrains; its output follows the constraint."""
    import re
    import time
    import urllib.request

    from ember_cupy.config import EngineConfig
    from ember_cupy.engine.llm_engine import LLMEngine
    from ember_cupy.server import AsyncEngine, BackgroundServer, EngineMetrics, ServerSettings
    engine = LLMEngine(checkpoint, EngineConfig(max_model_len=256, kv_cache_memory=64 << 20))
    settings = ServerSettings(host="127.0.0.1", port=0, served_model_names=["gemma"])
    server = BackgroundServer(AsyncEngine(engine, metrics=EngineMetrics("gemma")), settings).start()

    def complete(**fields) -> str:
        body = json.dumps({"model": "gemma", "prompt": "The answer is", "max_tokens": 6, "temperature": 0,
                           **fields}).encode()
        request = urllib.request.Request(server.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.load(response)["choices"][0]["text"]

    try:
        complete()
        time.sleep(0.5)
        assert not engine.grammars.tokenizer_built
        text = complete(structured_outputs={"regex": "[0-9]{3}"})
        assert re.fullmatch("[0-9]{3}", text), text
        assert engine.grammars.tokenizer_built
    finally:
        server.stop()
