"""tools/soak.py: a small soak of the real server (spawned as `ember-cupy serve`; concurrent
streams, some dropped at random moments, two rounds) ends every round idle with every KV block
free; a server that leaks a block or never ends its streams fails it."""
from __future__ import annotations

import os
import sys

import pytest
from defective_server import DefectiveServer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import soak  # noqa: E402

pytestmark = pytest.mark.soak


def test_small_soak_of_the_real_server_leaves_it_idle(capsys, tmp_path):
    status = soak.main(["--streams", "16", "--rounds", "2", "--max-tokens", "8", "--seed", "3",
                        "--server-args", "--max-model-len 256 --kv-cache-memory 16MiB --max-num-seqs 8",
                        "--server-log", str(tmp_path / "server.log")])
    out = capsys.readouterr().out
    assert status == 0, out
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2, out
    for line in rounds:
        assert "16 streams" in line and "0 failures" in line, line
        assert "running 0, waiting 0" in line, line
        assert "dropped: none" not in line, line     # 30% of 16: some streams were dropped


def test_soak_fails_on_a_leaked_block_and_on_streams_without_done(capsys):
    with DefectiveServer({"leak", "unterminated_stream"}) as server:
        status = soak.main(["--url", server.url, "--streams", "8", "--rounds", "1", "--max-tokens", "4",
                            "--idle-timeout", "0.5"])
    out = capsys.readouterr().out
    assert status == 1
    assert "not idle 0.5 s after the round: running 0, waiting 0, free KV blocks 9/10" in out
    assert "ended without [DONE]" in out
