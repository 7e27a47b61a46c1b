"""How many bytes the process has allocated with malloc, to weigh what a grammar compile keeps.

llguidance allocates with the C library's malloc and offers no size of its own; glibc's
mallinfo2() reports the bytes in use (heap chunks and mmap'd blocks), so the growth across a
compile is what the compiled grammar holds. It counts every thread, so an engine step running
meanwhile moves it by its transient arrays (a few MB); callers serialise compiles. Without
mallinfo2 (not glibc, or glibc < 2.33) the resident set size stands in.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def _mallinfo2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def allocated_bytes() -> int:
    """Bytes in use by malloc (glibc), else the resident set size, else 0."""
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        return info.uordblks + info.hblkhd
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
