"""The one warning a model load on NumPy gives where the host kernels cannot be built for want of
a C compiler: the NumPy path runs, and what the quantized matrices dequantized once at load
(model/weights.py) cost in memory. Other reasons the kernels failed to load were warned about
by ops/_host.active() with the compiler's error; the cost is then logged as information."""
from __future__ import annotations

import logging

from ember_cupy.ops import _host
from ember_cupy.packed_weight import DequantizedWeight

logger = logging.getLogger("ember_cupy.host")

_INSTALL = "install a C compiler (cc, gcc or clang, or set CC) for the host kernels"


def report(weights) -> None:
    """Log the NumPy fallback of a loaded model, given its weights (each tensor once)."""
    reason = _host.unavailable()
    if reason is None:
        return
    dequantized = [w for w in weights if isinstance(w, DequantizedWeight)]
    cost = _cost(dequantized)
    if isinstance(reason, _host.NoCompilerError):
        logger.warning("host kernels unavailable (%s): the NumPy path runs (slow)%s; %s", reason, cost, _INSTALL)
    elif dequantized:
        logger.info("host kernels unavailable: the NumPy path runs%s", cost)


def _cost(dequantized: list[DequantizedWeight]) -> str:
    if not dequantized:
        return ""
    floats = sum(w.nbytes for w in dequantized) / 2**20
    packed = sum(w.packed_bytes for w in dequantized) / 2**20
    return (f", with the {len(dequantized)} quantized matrices dequantized once at load: "
            f"{floats:.0f} MiB of float32 instead of {packed:.0f} MiB packed")
