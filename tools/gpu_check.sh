#!/usr/bin/env bash
# The device check lives in tools/gpu_check.py (Python + CuPy only on the device; see its
# docstring). This wrapper keeps the old entry: `bash tools/gpu_check.sh [--dry-run]`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" tools/gpu_check.py run "$@"
