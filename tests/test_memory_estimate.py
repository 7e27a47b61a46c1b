"""The device memory estimate leaves room for the logits a step really makes: with prompt logprobs
every scheduled token is a logits row, up to max_num_batched_tokens of them (issue 11 item 3)."""
from __future__ import annotations

from ember_cupy import SamplingParams
from ember_cupy.engine.model_runner import logits_workspace_bytes


def test_prompt_logprob_logits_fit_the_estimate(make_llm):
    llm = make_llm(max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=32, block_size=16)
    model = llm.engine.runner.model
    made = []
    logits = model.logits

    def recording(x):
        out = logits(x)
        made.append(int(out.nbytes))
        return out

    model.logits = recording
    prompt = [1000 + i for i in range(100)]   # two chunks of at most 64 tokens
    llm.generate([prompt, prompt[:40]], SamplingParams(max_tokens=2, prompt_logprobs=0, n=2))
    config, vocab = llm.engine.config, llm.engine.model_config.vocab_size
    assert max(made) == 64 * vocab * 4                        # a whole chunk of prompt rows
    assert max(made) > 2 * config.max_num_seqs * vocab * 4    # what the estimate used to allow
    assert max(made) <= logits_workspace_bytes(config, llm.engine.model_config)
