"""tools/profile_step.py times the real forward, op by op, without changing its results."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import profile_step  # noqa: E402

from ember_cupy import SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time there was a robot who"]
OPS = {"gemm qkv", "apply_rope", "write_kv", "paged_attention", "gemm o", "rms_norm",
       "fused_add_rms_norm", "gemm gate_up", "silu_and_mul", "gemm down", "lm_head", "embedding"}


def generate(llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, [(t.token_id, t.logprob) for t in o.outputs[0].logprobs])
            for o in outputs]


def test_profiling_times_every_op_and_changes_nothing(make_llm):
    llm = make_llm(enable_prefix_caching=False)
    plain = generate(llm)
    clock = profile_step.OpClock()
    with profile_step.profiling(llm, clock) as total:
        assert generate(llm) == plain
    assert OPS <= set(clock.seconds) and all(s >= 0 for s in clock.seconds.values())
    assert 0 < sum(clock.seconds.values()) <= total["forward"]
    before = dict(clock.seconds)
    generate(llm)                                   # profiling off: nothing is charged
    assert clock.seconds == before


def test_cli_reports_every_op_for_decode_steps(capsys):
    assert profile_step.main(["--batch", "2", "--context", "20", "--steps", "3", "--json", "--op-by-op"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "decode" and result["batch"] == 2
    assert OPS <= set(result["ops_ms"])
    assert {"python", "engine"} <= set(result["ops_ms"])
    assert abs(sum(result["ops_ms"].values()) - result["ms_per_step"]) <= 0.05 * result["ms_per_step"] + 0.1
