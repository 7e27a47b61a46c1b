"""Prompt tokens' matmuls in bf16 on AMX-BF16 tiles or AVX512-BF16 vectors (EngineConfig.prompt_activations = auto), the
generated tokens' as activation_passes says, through the public API on the default model."""
import numpy as np
import pytest

from ember_cupy import LLM, SamplingParams
from ember_cupy.config import EngineConfig
from ember_cupy.ops import linear
from ember_cupy.ops.linear import bf16_prompts_ready, bf16_tiles_ready

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3)


def _bf16_rows_op_by_op(llm, monkeypatch) -> int:
    """Rows the op-by-op forward sends through matmul_q_bf16 while llm generates PROMPTS."""
    rows = []
    kernel = linear.matmul_q_bf16
    monkeypatch.setattr(linear, "matmul_q_bf16", lambda x, weight, library=None: rows.append(len(x)) or kernel(x, weight))
    llm.engine.runner.model.fuse_layers = False
    llm.generate(PROMPTS, GREEDY)
    return sum(rows)


@pytest.mark.skipif(not bf16_prompts_ready(), reason="neither AMX-BF16 tiles nor AVX512-BF16 on this machine")
def test_prompt_rows_and_only_they_take_the_bf16_tiles(checkpoint, monkeypatch):
    llm = LLM(checkpoint, max_num_batched_tokens=8, enable_prefix_caching=False)
    matmuls = 4 * llm.engine.model_config.num_layers         # qkv, o, gate_up, down a layer
    prompt_tokens = sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    assert _bf16_rows_op_by_op(llm, monkeypatch) == matmuls * prompt_tokens
    assert _bf16_rows_op_by_op(LLM(checkpoint, prompt_activations="int8"), monkeypatch) == 0


@pytest.mark.skipif(not bf16_prompts_ready(), reason="neither AMX-BF16 tiles nor AVX512-BF16 on this machine")
def test_bf16_prompts_stay_close_to_int8_prompts(checkpoint):
    """The same greedy tokens; prompt logprobs within a few hundredths of a nat of the int8 path's
    (x kept to 8 bits, not ~15), and not equal to them (the tiles did run)."""
    outputs = {mode: LLM(checkpoint, prompt_activations=mode).generate(PROMPTS, GREEDY) for mode in ("auto", "int8")}
    differ = False
    for auto, int8 in zip(outputs["auto"], outputs["int8"], strict=True):
        assert auto.outputs[0].token_ids == int8.outputs[0].token_ids
        for a, b in zip(auto.prompt_logprobs[1:], int8.prompt_logprobs[1:], strict=True):
            assert a.token_id == b.token_id
            np.testing.assert_allclose(a.logprob, b.logprob, atol=0.1)
            differ |= a.logprob != b.logprob
    assert differ


def test_prompt_activations_is_checked():
    with pytest.raises(ValueError, match="prompt_activations"):
        EngineConfig(prompt_activations="fp8")


def test_the_cpu_prefill_budget_doubles_where_prompt_rows_take_the_tiles(checkpoint):
    """A server's prompt tokens per shared step (EngineConfig.max_num_prefill_tokens=None): 64 of
    them on the tiles cost about what 32 int8 ones did."""
    from ember_cupy.config import CPU_MAX_NUM_PREFILL_TOKENS, CPU_MAX_NUM_PREFILL_TOKENS_BF16
    from ember_cupy.engine.llm_engine import LLMEngine
    budget = {mode: LLMEngine(checkpoint, EngineConfig(prompt_activations=mode)).config.max_num_prefill_tokens
              for mode in ("auto", "int8")}
    assert budget == {"auto": CPU_MAX_NUM_PREFILL_TOKENS_BF16 if bf16_tiles_ready() else CPU_MAX_NUM_PREFILL_TOKENS,
                      "int8": CPU_MAX_NUM_PREFILL_TOKENS}
