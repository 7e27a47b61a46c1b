"""tools/profile_step.py: its instrumented forward must stay the model's forward."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import profile_step  # noqa: E402

from ember_cupy import SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time there was a robot who"]
OPS = {"gemm qkv", "rope", "write_kv", "attention", "gemm o", "norm", "gemm gate_up",
       "silu_and_mul", "gemm down", "lm_head"}


def generate(llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, [(t.token_id, t.logprob) for t in o.outputs[0].logprobs])
            for o in outputs]


def test_timed_forward_gives_the_same_tokens_and_logprobs(make_llm):
    plain = generate(make_llm(enable_prefix_caching=False))
    llm = make_llm(enable_prefix_caching=False)
    clock = profile_step.OpClock()
    profile_step.install(llm, clock)
    assert generate(llm) == plain
    assert OPS <= set(clock.seconds) and all(s >= 0 for s in clock.seconds.values())


def test_cli_reports_every_op_for_decode_steps(capsys):
    assert profile_step.main(["--batch", "2", "--context", "20", "--steps", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "decode" and result["batch"] == 2
    assert OPS <= set(result["ops_ms"])
    assert 0 < sum(result["ops_ms"].values()) <= result["ms_per_step"] * 1.05
