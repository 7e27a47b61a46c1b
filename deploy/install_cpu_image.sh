#!/bin/sh
# The CPU image's install steps (Dockerfile.cpu runs exactly this script), so they can also run,
# and be tested, outside Docker: `deploy/install_cpu_image.sh /path/to/venv` in a clean venv.
#   1. the package with the default model and the Ray extra,
#   2. the host kernels compiled now, for every ISA the kernels have, into EMBER_KERNEL_CACHE,
#      so a container never needs a compiler at run time (the one it runs picks its CPU's ISA),
#   3. a smoke check: `ember-cupy info` says the host kernels are active.
set -eu
PREFIX=${1:-/opt/ember}
EXTRAS=${EMBER_EXTRAS:-default-model,ray}
SRC=$(cd "$(dirname "$0")/.." && pwd)
[ -x "$PREFIX/bin/python" ] || python3 -m venv "$PREFIX"
"$PREFIX/bin/pip" install --no-cache-dir "$SRC[$EXTRAS]"
export EMBER_KERNEL_CACHE=${EMBER_KERNEL_CACHE:-$PREFIX/kernels}
for isa in portable avx2 avx512vnni; do
    EMBER_HOST_ISA=$isa "$PREFIX/bin/python" -c "from ember_cupy.ops import _host; _host._build('$isa')"
done
"$PREFIX/bin/ember-cupy" info | "$PREFIX/bin/python" -c \
    "import json, sys; info = json.load(sys.stdin); assert info['host_kernels']['active'], info; print(info['host_kernels'])"
ls "$EMBER_KERNEL_CACHE"
