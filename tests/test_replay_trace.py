import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL, TRACE = ROOT / "tools" / "replay_trace.py", ROOT / "tools" / "traces" / "example.jsonl"


def _replay(*flags):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(TOOL), str(TRACE), "--json", *flags],
                         check=True, capture_output=True, text=True, cwd=ROOT, env=env)
    return json.loads(out.stdout)


def test_same_trace_same_schedule_across_processes():
    assert _replay("--policy", "sjf", "--num-blocks", "40") == _replay("--policy", "sjf", "--num-blocks", "40")


def test_policies_change_the_schedule_and_everyone_finishes():
    results = {p: _replay("--policy", p, "--num-blocks", "40", "--max-num-seqs", "2") for p in ("fcfs", "sjf", "priority")}
    for result in results.values():
        assert all(r["finish_reason"] == "length" and r["queue_steps"] >= 0 for r in result["requests"])
    starts = {p: [r["first_scheduled_step"] for r in res["requests"]] for p, res in results.items()}
    assert starts["fcfs"] != starts["sjf"] and starts["fcfs"] != starts["priority"]


def test_shared_prefix_hits_the_cache():
    cached = [r["num_cached_tokens"] for r in _replay("--num-blocks", "200")["requests"]]
    assert sum(cached) > 0
    assert all(c == 0 for c in [r["num_cached_tokens"] for r in _replay("--num-blocks", "200", "--no-prefix-caching")["requests"]])
