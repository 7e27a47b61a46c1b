"""Where a first load packs its weights: a region of anonymous memory in small pages, which the
weight cache later swaps for the pages of the file it wrote from it (same bytes, same addresses).

Why small pages first: on a microVM the host takes back the guest's free 2 MiB blocks (free page
reporting), so every fresh huge page is faulted in from the host; small pages come from free
fragments that were never given back. Touching 680 MB (the 1B Q4_K_M shape packed) after 15 s idle:
1.84-1.91 s in NumPy's huge-page-advised arrays, 0.26-0.37 s in small pages. But a decode step
reads its weights faster through 2 MiB mappings (that shape: 31-35 ms a token against 37-41 ms in
small pages), which a file mapping of the page cache gives (`FilePmdMapped` in smaps) where the
address and the file offset agree modulo 2 MiB: the region starts on a 2 MiB boundary, so offset
o of the file lands at base + o. Swapping the mapping is one mmap(MAP_FIXED) over the region:
a thread reading the weights meanwhile waits out the call and reads the same bytes after it.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys

import numpy as np

logger = logging.getLogger("ember_cupy.weights")

HUGE_PAGE = 2 << 20
_MAP_FIXED = 0x10   # Linux's value on every architecture it runs on
# The region is a bound (2 bytes a weight): only what is packed should count against the commit
# limit, as the sparse file the region replaces did not count at all. x86-64 and arm64 Linux value
# (asm-generic/mman.h), which Python 3.11's mmap module does not name.
_NO_RESERVE = 0x4000 if sys.platform.startswith("linux") else 0


@functools.lru_cache(maxsize=1)
def _libc_mmap():
    """libc's mmap(addr, length, prot, flags, fd, offset), which Python's mmap module cannot call
    with an address."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return libc.mmap


class PackRegion:
    """size bytes of private anonymous memory from a 2 MiB boundary; its pages are touched only
    where something is packed (address space is all an unused tail costs)."""

    def __init__(self, size: int):
        self._map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | _NO_RESERVE)
        whole = np.frombuffer(self._map, np.uint8)
        start = -whole.ctypes.data % HUGE_PAGE
        self.bytes = whole[start:start + size]   # the region's views keep the mapping alive

    def array(self, offset: int, shape, dtype) -> np.ndarray:
        count = int(np.prod(shape))
        return np.frombuffer(self.bytes, dtype, count, offset).reshape(shape)

    def map_file(self, fd: int, length: int) -> bool:
        """Bytes [0, length) of the region become a read-only shared mapping of the file's first
        length bytes (which must hold what the region holds). False where the platform has no
        such call or refuses it: the region then stays as it is."""
        if not sys.platform.startswith("linux") or length <= 0 or length > self.bytes.nbytes:
            return False
        address = self.bytes.ctypes.data
        length = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
        result = _libc_mmap()(address, length, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if result != address:
            logger.warning("packed weights stay in anonymous memory: mmap over them failed (errno %d)",
                           ctypes.get_errno())
            return False
        return True

