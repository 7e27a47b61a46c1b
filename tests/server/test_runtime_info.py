"""`GET /version` and `ember-cupy info` say which host-kernel path and weight format are active,
and what a request's bits do not depend on."""
import json
import subprocess
import sys

from server_helpers import http

from ember_cupy.ops import _host


def test_version_reports_the_host_kernels_and_the_served_format(base_url):
    status, _, body = http(base_url, "GET", "/version")
    info = json.loads(body)
    assert status == 200 and info["backend"] == "numpy"
    assert info["host_kernels"]["active"] and info["host_kernels"]["isa"] == _host.best_isa()
    assert info["quantization"] == "auto"
    assert 80e6 < info["weight_bytes"] < 110e6      # Q4_1 matrices + Q8_0 embedding, held once
    assert info["peak_rss_bytes"] > info["weight_bytes"]
    assert info["determinism"] == {"bit_identical_across": ["batch", "prefix_cache", "chunked_prefill",
                                                            "preemption", "thread_count"]}


def test_float_matrices_are_reported_as_not_bit_identical(make_llm):
    from ember_cupy.info import runtime_info
    info = runtime_info(make_llm(quantization="none").engine)
    assert info["determinism"]["bit_identical_across"] == []
    assert "float matrices" in info["determinism"]["why_not"]


def test_info_command_prints_the_path_it_would_use():
    out = subprocess.run([sys.executable, "-m", "ember_cupy.cli", "info"], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    info = json.loads(out)
    assert info["host_kernels"]["isa"] == _host.best_isa()
    assert set(info["host_kernels"]["cpu_supports"]) >= {"portable"}
