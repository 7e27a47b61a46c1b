"""tools/attack_http.py --quick against a test server (in this process, so its resident memory is
this process's): every attack runs at its base size and grown 10x, and the server neither crashes
nor breaks a constraint silently, and sheds what it must (metadata past OpenAI's bounds)."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import attack_http  # noqa: E402

pytestmark = pytest.mark.attack


def test_quick_attack_of_a_test_server(base_url, tmp_path):
    report = tmp_path / "attack.json"
    status = attack_http.main(["--url", base_url, "--server-pid", str(os.getpid()), "--quick",
                               "--baseline-seconds", "1", "--min-probes", "1", "--timeout", "120",
                               "--report", str(report)])
    summary = json.loads(report.read_text())
    attacks = {(a["name"], a["growth"]): a for a in summary["attacks"]}
    assert set(attacks) == {(name, growth) for name in attack_http.ATTACKS for growth in attack_http.GROWTH}
    problems = [line for a in summary["attacks"] for line in a["crashes"] + a["constraint_breaks"]]
    assert (status, problems, summary["after_run_problems"]) == (0, [], [])
    for attack in summary["attacks"]:
        assert attack["rss_growth_bytes_per_request"] is not None and attack["small_requests"] >= 1, attack
    assert attacks["responses", 10]["statuses"].get("400") == 1   # 170 metadata pairs: refused
    assert summary["baseline"]["small_request_p99_s"] is not None
