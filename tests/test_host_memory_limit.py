"""host_memory: the machine's memory, or its container's cgroup limit when lower."""
from __future__ import annotations

import pytest

from ember_cupy import host_memory


@pytest.mark.parametrize("v2, v1, expected", [
    ("max\n", None, None),                          # cgroup v2, no limit
    ("536870912\n", None, 512 << 20),                # cgroup v2, 512 MiB
    (None, "9223372036854771712\n", None),            # cgroup v1's "no limit"
    (None, "1073741824", 1 << 30),                    # cgroup v1, 1 GiB
    (None, None, None),                               # neither file: not in a container
])
def test_cgroup_limit(tmp_path, v2, v1, expected):
    files = []
    for name, text in (("memory.max", v2), ("memory.limit_in_bytes", v1)):
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        files.append(str(path))
    assert host_memory.cgroup_limit(tuple(files)) == expected


def test_memory_limit_is_the_lower_of_machine_and_container(monkeypatch):
    monkeypatch.setattr(host_memory, "physical_memory", lambda: 24 << 30)
    monkeypatch.setattr(host_memory, "cgroup_limit", lambda: 2 << 30)
    assert host_memory.memory_limit() == 2 << 30
    monkeypatch.setattr(host_memory, "cgroup_limit", lambda: None)
    assert host_memory.memory_limit() == 24 << 30
    monkeypatch.setattr(host_memory, "physical_memory", lambda: None)
    assert host_memory.memory_limit() is None


def test_a_pool_within_the_limit_passes_and_one_beyond_it_is_refused(monkeypatch):
    monkeypatch.setattr(host_memory, "memory_limit", lambda: 2 << 30)
    host_memory.check_fits_in_memory(2 << 30, "kv_cache_memory")
    with pytest.raises(ValueError, match=r"kv_cache_memory asks for 3.0 GiB .* 2.0 GiB of memory"):
        host_memory.check_fits_in_memory(3 << 30, "kv_cache_memory")
    monkeypatch.setattr(host_memory, "memory_limit", lambda: None)   # unknown: nothing to hold it to
    host_memory.check_fits_in_memory(99 << 40, "kv_cache_memory")
