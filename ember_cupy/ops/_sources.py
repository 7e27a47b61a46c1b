"""Where kernel sources live: a top-level folder of a source checkout (editable install), else the
copy a wheel installs as data under share/ember_cupy/."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def kernel_source_dir(folder: str, env_var: str) -> Path:
    """`env_var` if set, else <checkout>/<folder>, else <prefix>/share/ember_cupy/<folder>."""
    if env_var in os.environ:
        return Path(os.environ[env_var])
    checkout = Path(__file__).resolve().parents[2] / folder
    installed = Path(sys.prefix) / "share" / "ember_cupy" / folder
    return checkout if checkout.is_dir() or not installed.is_dir() else installed
