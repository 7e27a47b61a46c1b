"""tools/verification_cost.py: the cost of verifying drafts on the real model, and the acceptance
at which it pays."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import verification_cost  # noqa: E402


def test_break_even_acceptance_repays_the_cost_ratio():
    for ratio, k in ((1.11, 1), (1.97, 4), (3.0, 2)):
        a = verification_cost.break_even_acceptance(ratio, k)
        assert sum(a ** i for i in range(k + 1)) == pytest.approx(ratio, rel=1e-9)
    assert verification_cost.break_even_acceptance(1.0, 4) == pytest.approx(0.0, abs=1e-9)
    assert verification_cost.break_even_acceptance(5.2, 4) is None   # even all accepted: 5 tokens


def test_the_tool_times_the_default_model(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert verification_cost.main(["--models", "smollm2", "--batch", "1,2", "--drafts", "2",
                                   "--repeats", "1", "--out", str(out)]) == 0
    [result] = json.loads(out.read_text())
    rows = {r["batch"]: r for r in result["rows"]}
    assert set(rows) == {1, 2} and all(r["drafts"] == 2 and r["plain_ms"] > 0 for r in rows.values())
    assert all(r["cost_ratio"] == pytest.approx(r["verify_ms"] / r["plain_ms"]) for r in rows.values())
    assert "| smollm2 | 1 | 2 |" in capsys.readouterr().out
