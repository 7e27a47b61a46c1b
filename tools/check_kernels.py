#!/usr/bin/env python3
"""Compile check of every cuda/*.cu, through nvcc AND through NVRTC (the path CuPy takes at run time,
called with an explicit -arch since CuPy's own compile path needs a device), for each target arch.

Fails on any warning, on a kernel over the register budget, and on any spill or local memory,
all parsed from ptxas -v. Prints one line per (file, arch, compiler). No GPU needed.
Usage: python tools/check_kernels.py [--arch 80 90] [--max-registers 96]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ember_cupy.ops import _cuda

PTXAS_VERBOSE = ["-v", "-warn-spills", "-warn-lmem-usage"]
ENTRY = re.compile(r"Compiling entry function '(\w+)'")
USAGE = re.compile(r"Used (\d+) registers")
SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def nvcc(source: Path, arch: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            ["nvcc", f"-arch=sm_{arch}", "-cubin", "-std=c++17", "-Werror", "all-warnings",
             f"-I{_cuda.CUDA_SOURCE_DIR}", "-Xptxas", ",".join(PTXAS_VERBOSE), "-o",
             f"{tmp}/out.cubin", str(source)], capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(result.stderr)
    return result.stderr


def nvrtc(source: Path, arch: str) -> str:
    options = _cuda.NVRTC_OPTIONS + tuple(f"--ptxas-options={flag}" for flag in PTXAS_VERBOSE)
    _, log = _cuda.nvrtc_compile(source.name, arch, options)
    return log


def problems(log: str, max_registers: int) -> tuple[list[str], int]:
    """Warnings, register overruns, spills; and the kernel count, from a compiler log."""
    found, kernel, kernels = [], "?", 0
    for line in log.splitlines():
        if "warning" in line.lower():
            found.append(line.strip())
        if match := ENTRY.search(line):
            kernel, kernels = match.group(1), kernels + 1
        if (match := USAGE.search(line)) and int(match.group(1)) > max_registers:
            found.append(f"{kernel}: {match.group(1)} registers > budget {max_registers}")
        if (match := SPILLS.search(line)) and any(int(v) for v in match.groups()):
            found.append(f"{kernel}: {match.group(0)}")
    return found, kernels


def check(job: tuple[Path, str, str], max_registers: int) -> tuple[str, list[str]]:
    source, arch, compiler = job
    label = f"{source.name:16} sm_{arch} {compiler:5}"
    try:
        log = (nvcc if compiler == "nvcc" else nvrtc)(source, arch)
    except Exception as error:  # noqa: BLE001 -- any compile failure: its log is the finding
        return f"{label} FAILED", [str(error)]
    found, kernels = problems(log, max_registers)
    if kernels == 0:
        found.append("no kernel entry found in the ptxas log")
    return f"{label} {kernels:2} kernels {'FAILED' if found else 'ok'}", found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=["80", "90"])
    parser.add_argument("--max-registers", type=int, default=96)
    args = parser.parse_args()
    sources = sorted(_cuda.CUDA_SOURCE_DIR.glob("*.cu"))
    jobs = [(s, a, c) for s in sources for a in args.arch for c in ("nvcc", "nvrtc")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda job: check(job, args.max_registers), jobs))
    failed = 0
    for line, found in results:
        print(line)
        for problem in found:
            print("    " + problem.replace("\n", "\n    "))
        failed += bool(found)
    print(f"check_kernels: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
