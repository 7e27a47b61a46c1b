"""`GET /version` and `ember-cupy info` say which host-kernel path and weight format are active,
and what a request's bits do not depend on."""
import json
import subprocess
import sys

from server_helpers import http

from ember_cupy.ops import _host
from ember_cupy.ops.linear import bf16_prompts_ready


def test_version_reports_the_host_kernels_and_the_served_format(base_url):
    status, _, body = http(base_url, "GET", "/version")
    info = json.loads(body)
    assert status == 200 and info["backend"] == "numpy"
    assert info["host_kernels"]["active"] and info["host_kernels"]["isa"] == _host.best_isa()
    assert info["quantization"] == "auto"
    assert info["prompt_activations"] == ("bf16" if bf16_prompts_ready() else "int8")
    assert 80e6 < info["weight_bytes"] < 110e6      # Q4_1 matrices + Q8_0 embedding, held once
    assert info["peak_rss_bytes"] > info["weight_bytes"]
    assert info["determinism"] == {"bit_identical_across": ["batch", "prefix_cache", "chunked_prefill",
                                                            "preemption", "thread_count"]}


def test_float_matrices_on_the_host_kernels_are_reported_bit_identical_too(make_llm, monkeypatch):
    from ember_cupy.info import INVARIANT_ACROSS, runtime_info
    from ember_cupy.ops import _host
    assert runtime_info(make_llm(quantization="none").engine)["determinism"]["bit_identical_across"] == INVARIANT_ACROSS
    monkeypatch.setattr(_host, "active", lambda: None)     # the NumPy twins (tests/test_batch_invariance.py)
    assert runtime_info()["determinism"]["bit_identical_across"] == INVARIANT_ACROSS[:-1]


def test_info_command_prints_the_path_it_would_use():
    out = subprocess.run([sys.executable, "-m", "ember_cupy.cli", "info"], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    info = json.loads(out)
    assert info["host_kernels"]["isa"] == _host.best_isa()
    assert set(info["host_kernels"]["cpu_supports"]) >= {"portable"}
