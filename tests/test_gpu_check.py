"""tools/gpu_check.py's CPU dry run: the device check's every step (facts, kernels vs twins with
poisoned outputs, e2e against the carried NumPy reference, decode timing) on the stand-in cupy,
from a payload prepared as for the device call, whose size must travel (64 MiB with the repo)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import gpu_payload  # noqa: E402


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
    folder = tmp_path_factory.mktemp("payload")
    sizes = gpu_payload.prepare(folder)
    return folder, sizes


def test_payload_travels_and_holds_what_the_image_lacks(payload, tmp_path):
    folder, sizes = payload
    assert sizes["repo"] + sizes["payload"] < gpu_payload.CARRY_LIMIT
    reference = json.loads(gpu_payload.REFERENCE.read_text())
    assert gpu_payload.sha256(folder / "model.gguf") == reference["model"]["sha256"]
    assert gpu_payload.site_imports(folder, tmp_path / "site")
    assert sorted(p.name for p in (folder / "include").iterdir()) == sorted(gpu_payload.HEADERS)


def test_dry_run_passes_every_step(payload, tmp_path):
    folder, _ = payload
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("EMBER_BACKEND", None)
    result = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "run", "--dry-run",
                             "--payload", str(folder), "--out", str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=1200)
    steps = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert [s["step"].split(",")[0].split(" ")[0] for s in steps] == ["facts", "kernels", *["e2e"] * 5,
                                                                          "decode", "decode"]
    assert all(s["passed"] for s in steps)
    kernels = {c["kernel"].split("(")[0].split(" ")[0] for c in steps[1]["cases"]}
    assert {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary", "write_kv",
            "paged_attention", "apply_token_bitmask", "apply_logit_edits", "sample_rows", "raw_logprobs",
            "matmul_q", "embedding"} <= kernels
    quantized = [s for s in steps if s.get("quantization") == "auto"]
    assert [s["step"].split(" ")[0] for s in quantized] == ["e2e", "e2e", "decode"]
    assert quantized[0]["equal_tokens"] == quantized[0]["total_tokens"] > 0
    assert quantized[-1]["weights_bytes"] < steps[-2]["weights_bytes"] / 2   # blocks, not bf16
    reference = json.loads(gpu_payload.REFERENCE.read_text())
    e2e = steps[2]
    assert e2e["equal_tokens"] == e2e["total_tokens"] > 0
    assert all(e2e["tokens"][rid] == reference["tokens"][rid][:len(e2e["tokens"][rid])] for rid in e2e["tokens"])
    assert steps[-1]["rows"][0]["ms_per_step"] > 0
