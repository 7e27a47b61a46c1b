"""How much memory this process may hold: the machine's, or its container's limit when lower.

The host KV pool is a lazy mapping (backend.lazily_zeroed): asking for more than the machine has
succeeds at start and ends with the OOM killer once requests fill it (or, past what the kernel
maps at all, with a bare ENOMEM). The model runner checks the pool against this limit first, so
a mistaken --kv-cache-memory fails at start and says so.
"""
from __future__ import annotations

import os

# cgroup v2's file, then v1's; "max" (v2) or a huge number (v1) means no limit
_CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
_NO_LIMIT = 1 << 60


def physical_memory() -> int | None:
    """The machine's RAM in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cgroup_limit(files: tuple[str, ...] = _CGROUP_LIMIT_FILES) -> int | None:
    """The memory limit of this process's container (cgroup v2 or v1) in bytes, None if none."""
    for path in files:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _NO_LIMIT:
            return int(text)
        return None
    return None


def memory_limit() -> int | None:
    """The most memory this process can ever hold, in bytes (None: unknown)."""
    limits = [limit for limit in (physical_memory(), cgroup_limit()) if limit]
    return min(limits) if limits else None


def check_fits_in_memory(pool_bytes: int, what: str) -> None:
    """ValueError when a host KV pool of pool_bytes could never be resident: its lazy mapping
    would be granted, and the OOM killer would end the server once requests filled it."""
    limit = memory_limit()
    if limit is not None and pool_bytes > limit:
        raise ValueError(f"{what} asks for {pool_bytes / 2**30:.1f} GiB of KV cache, more than the "
                         f"{limit / 2**30:.1f} GiB of memory this machine (or its container) has: the "
                         f"server would be killed once requests filled it; ask for less")
