"""tools/determinism_check.py at a few trials against a test server: the same completion bits
alone, in random batches, and with the prefix cache covering random fractions of the prompt
(greedy and seeded). The full run (50 trials per mode) is the tool's."""
from __future__ import annotations

import json
import os
import sys

import pytest

from ember_cupy.ops import _host

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import determinism_check  # noqa: E402


@pytest.mark.skipif(_host.active() is None, reason="host kernels unavailable (no C compiler)")
def test_one_output_per_mode_through_http(base_url, tmp_path):
    report = tmp_path / "determinism.json"
    status = determinism_check.main(["--url", base_url, "--trials", "3", "--prompt-tokens", "150",
                                      "--max-tokens", "4", "--max-others", "4", "--report", str(report)])
    results = json.loads(report.read_text())
    assert {(r["mode"], r["sampling"]) for r in results} == {
        (mode, sampling) for mode in determinism_check.MODES for sampling in determinism_check.SAMPLINGS}
    assert [r for r in results if r["distinct"] != 1 or r["trials"] != 3] == []
    assert status == 0
