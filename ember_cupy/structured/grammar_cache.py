"""A least-recently-used cache bounded by the bytes its entries hold, and by their number."""
from __future__ import annotations

import threading
from collections import OrderedDict


class ByteBoundedCache:
    def __init__(self, max_bytes: int, max_entries: int):
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict = OrderedDict()   # key -> (value, bytes)
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key):
        """The value of key (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key, value, nbytes: int) -> None:
        """Keep value under key, evicting the least recently used until both bounds hold; a value
        larger than max_bytes alone is not kept."""
        with self._lock:
            if key in self._entries:
                self._bytes -= self._entries.pop(key)[1]
            if nbytes > self.max_bytes:
                return
            self._entries[key] = (value, nbytes)
            self._bytes += nbytes
            while self._bytes > self.max_bytes or len(self._entries) > self.max_entries:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_bytes(self) -> int:
        return self._bytes
