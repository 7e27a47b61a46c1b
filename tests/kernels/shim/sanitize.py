"""Runs Python under a sanitizer runtime: the shim's sanitizer builds need it preloaded.

ThreadSanitizer crashes some Python builds at start-up (pyenv's here); then the distribution's
python3 of the same version runs with this interpreter's site-packages instead.
"""
from __future__ import annotations

import functools
import os
import site
import subprocess
import sys

RUNTIMES = {"address": "libasan.so", "thread": "libtsan.so"}


def _runtime(kind: str) -> str:
    return subprocess.run(["g++", f"-print-file-name={RUNTIMES[kind]}"], capture_output=True,
                          text=True, check=True).stdout.strip()


@functools.cache
def sanitized_python(kind: str) -> tuple[list[str], dict] | None:
    """(argv prefix, environment) of a Python that runs with `kind`'s runtime, or None."""
    runtime = _runtime(kind)
    if not os.path.isabs(runtime):
        return None
    paths = [os.getcwd(), *site.getsitepackages(), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, LD_PRELOAD=runtime, EMBER_SHIM_SANITIZE=kind, EMBER_SHIM_MODE="threads",
               ASAN_OPTIONS="detect_leaks=0", PYTHONPATH=os.pathsep.join(filter(None, paths)))
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, f"/usr/bin/{version}"):
        probe = subprocess.run([python, "-c", "import numpy"], env=env, capture_output=True, check=False)
        if probe.returncode == 0:
            return [python], env
    return None
