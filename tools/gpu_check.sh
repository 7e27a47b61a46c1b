#!/usr/bin/env bash
# The prepared device check, for the day a GPU is lent (budget: under 5 minutes, nothing installed
# from the network; the device image has CuPy). In order:
#   1. device + toolchain facts;
#   2. every kernel through real CuPy vs the CPU shim vs the NumPy twin (tests/kernels/test_kernel_gpu.py);
#   3. end to end on the default model: greedy tokens of EMBER_BACKEND=cupy (float32, then float16)
#      vs the NumPy backend;
#   4. decode step timings at batch 1/16/64 (context 512) against the bytes-moved floor
#      (weights + KV read once per step, at the measured copy bandwidth);
#   5. a short table last. Everything also lands in ${OUT:-/tmp}/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python}
LOG=${OUT:-/tmp}/gpu_check.log
SUMMARY=$(mktemp)
: > "$LOG"
note() { echo "$*" | tee -a "$SUMMARY"; }
run() {  # name, command...
  local name=$1; shift
  local start=$SECONDS
  if timeout 240 "$@" >>"$LOG" 2>&1; then note "PASS  $name ($((SECONDS - start)) s)"; else note "FAIL  $name ($((SECONDS - start)) s)"; fi
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PYTHON" -c "import cupy; from cupy_backends.cuda.libs import nvrtc; print('cupy', cupy.__version__, 'nvrtc', nvrtc.getVersion(), 'cc', cupy.cuda.Device().compute_capability)"
} 2>&1 | tee -a "$LOG"

run "kernels: GPU vs shim vs NumPy" "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_kernel_gpu.py
tail -3 "$LOG"

e2e() {  # dtype
  "$PYTHON" - "$1" <<'PY'
import os, subprocess, sys, json
dtype = sys.argv[1]
code = """
import json, sys
from ember_cupy import SamplingParams
from ember_cupy.config import EngineConfig
from ember_cupy.engine.llm_engine import LLMEngine
prompts = ["The capital of France is", "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest was", "def fib(n):", "1, 2, 3, 4,"]
engine = LLMEngine(None, EngineConfig(max_num_batched_tokens=16, block_size=16, dtype=sys.argv[1], num_kv_blocks=64))
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
for i, p in enumerate(prompts): engine.add_request(str(i), p, params)
out = {}
while engine.has_unfinished_requests():
    for o in engine.step():
        if o.finished: out[o.request_id] = o.outputs[0].token_ids
print(json.dumps(out))
"""
def tokens(backend, dt):
    env = dict(os.environ, EMBER_BACKEND=backend)
    res = subprocess.run([sys.executable, "-c", code, dt], env=env, capture_output=True, text=True, timeout=200)
    if res.returncode: sys.exit(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])
gpu, cpu = tokens("cupy", dtype), tokens("numpy", "float32")
same = sum(a == b for k in cpu for a, b in zip(gpu[k], cpu[k]))
total = sum(len(v) for v in cpu.values())
print(f"e2e {dtype}: {same}/{total} greedy tokens equal to NumPy", gpu, cpu)
sys.exit(0 if same == total or dtype != "float32" else 1)
PY
}
run "e2e greedy, cupy float32 == numpy" e2e float32
run "e2e greedy, cupy float16 (agreement reported)" e2e float16
grep "^e2e" "$LOG" | cut -c1-60 | tee -a "$SUMMARY"

bench() {
  "$PYTHON" - <<'PY'
import numpy as np, cupy
from ember_cupy.config import EngineConfig
from ember_cupy.model.loader import load_checkpoint
from ember_cupy.model.llama import BatchMetadata
from ember_cupy.model.runner import ModelRunner
ckpt = load_checkpoint(None)
cfg, context, block = ckpt.config, 512, 16
runner = ModelRunner(ckpt, EngineConfig(dtype="float16", num_kv_blocks=64 * context // block + 64), xp=cupy)
model = runner.model
weights = sum(a.nbytes for a in [model.embed, model.norm] + [getattr(l, f) for l in model.layers
              for f in ("attn_norm", "qkv", "o", "ffn_norm", "gate_up", "down")])
buf = cupy.empty(1 << 30, np.uint8); dst = cupy.empty_like(buf)
start, end = cupy.cuda.Event(), cupy.cuda.Event()
start.record(); [dst.__setitem__(slice(None), buf) for _ in range(5)]; end.record(); end.synchronize()
bandwidth = 2 * 5 * buf.nbytes / (cupy.cuda.get_elapsed_time(start, end) / 1e3)
del buf, dst
print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights {weights / 1e6:.0f} MB")
for batch in (1, 16, 64):
    blocks = context // block
    tables = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks)
    positions = np.full(batch, context - 1, np.int32)
    meta = BatchMetadata(positions=cupy.asarray(positions),
                         slot_mapping=cupy.asarray(tables[:, -1] * block + block - 1),
                         block_tables=cupy.asarray(tables), context_lens=cupy.full(batch, context, np.int32),
                         query_start_loc=cupy.arange(batch + 1, dtype=np.int32),
                         logits_indices=cupy.arange(batch))
    ids = cupy.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, batch))
    for _ in range(3): model.forward(ids, meta, runner.kv_caches)
    start.record()
    for _ in range(20): model.forward(ids, meta, runner.kv_caches)
    end.record(); end.synchronize()
    ms = cupy.cuda.get_elapsed_time(start, end) / 20
    kv = batch * context * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    floor = (weights + kv) / bandwidth * 1e3
    print(f"decode batch {batch:3d}: {ms:7.3f} ms/step  floor {floor:6.3f} ms  ({ms / floor:5.1f}x floor)  {batch / ms * 1e3:9.0f} tok/s")
PY
}
run "decode timings (batch 1/16/64, context 512, fp16)" bench
grep -E "^decode|^copy" "$LOG" | tee -a "$SUMMARY"

echo
echo "==== gpu_check summary (full log: $LOG)"
cat "$SUMMARY"
grep -q "^FAIL" "$SUMMARY" && exit 1 || exit 0
