"""Per-step batch metadata for the device: one pinned host staging buffer, one persistent device
buffer, one host-to-device copy a step.

A step's metadata is seven small integer arrays (token ids, positions, slots, block tables,
context lengths, row offsets, logits rows). Sent one by one, each is a fresh device allocation
plus a pageable-memory copy that blocks the host. Packed into one pinned buffer they travel in a
single asynchronous copy into a buffer that lives as long as the runner; the device arrays the
forward pass gets are int32 views into it. Both buffers grow (doubling) when a step needs more.
"""
from __future__ import annotations

import numpy as np


class StepBuffers:
    def __init__(self, xp):
        self.xp = xp
        self._host: np.ndarray | None = None     # pinned int32 staging
        self._device = None                      # device int32, same capacity
        self._copied = None                      # event after the last copy out of _host

    def upload(self, arrays: list[np.ndarray]) -> list:
        """Host integer arrays -> int32 device views of the same shapes, in order. The views stay
        valid until the next upload (the next step's copy is queued after this step's kernels)."""
        total = sum(a.size for a in arrays)
        self._wait_for_last_copy()
        self._reserve(total)
        offset = 0
        for array in arrays:
            self._host[offset:offset + array.size] = array.ravel()
            offset += array.size
        self._device[:total].set(self._host[:total])
        self._copied = self.xp.cuda.Event()
        self._copied.record()
        views, offset = [], 0
        for array in arrays:
            views.append(self._device[offset:offset + array.size].reshape(array.shape))
            offset += array.size
        return views

    def _wait_for_last_copy(self) -> None:
        """The staging buffer is rewritten (or freed) only once the copy reading it is done."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def _reserve(self, count: int) -> None:
        if self._host is not None and self._host.size >= count:
            return
        capacity = max(count, 2 * (0 if self._host is None else self._host.size), 1024)
        pinned = self.xp.cuda.alloc_pinned_memory(capacity * 4)
        self._host = np.frombuffer(pinned, np.int32, capacity)
        self._device = self.xp.empty(capacity, np.int32)
