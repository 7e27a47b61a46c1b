import numpy as np
import pytest

from ember_cupy import backend


@pytest.fixture(autouse=True)
def fresh_choice():
    backend.get_backend_name.cache_clear()
    yield
    backend.get_backend_name.cache_clear()


def test_numpy_when_forced(monkeypatch):
    monkeypatch.setenv("EMBER_BACKEND", "numpy")
    assert backend.get_backend_name() == "numpy"
    assert backend.get_xp() is np


def test_auto_falls_back_to_numpy_without_a_device(monkeypatch):
    """A driver is there but CuPy finds no usable device: NumPy, not an error."""
    monkeypatch.delenv("EMBER_BACKEND", raising=False)
    monkeypatch.setattr(backend, "nvidia_driver_visible", lambda: True)
    monkeypatch.setattr(backend, "_cupy_or_reason", lambda: (None, "no CUDA device is visible"))
    assert backend.get_backend_name() == "numpy"
    assert backend.get_xp() is np


def test_auto_picks_cupy_when_a_device_is_usable(monkeypatch):
    monkeypatch.delenv("EMBER_BACKEND", raising=False)
    monkeypatch.setattr(backend, "nvidia_driver_visible", lambda: True)
    monkeypatch.setattr(backend, "_cupy_or_reason", lambda: (object(), ""))
    assert backend.get_backend_name() == "cupy"


def test_no_driver_means_numpy_without_importing_cupy(monkeypatch):
    monkeypatch.delenv("EMBER_BACKEND", raising=False)
    monkeypatch.setattr(backend, "nvidia_driver_visible", lambda: False)
    monkeypatch.setattr(backend, "_cupy_or_reason", lambda: pytest.fail("CuPy probed without a driver"))
    assert backend.get_backend_name() == "numpy"


def test_forcing_cupy_without_a_device_is_a_clear_error(monkeypatch):
    if backend._cupy_or_reason()[0] is not None:
        pytest.skip("a CUDA device is usable here")
    monkeypatch.setenv("EMBER_BACKEND", "cupy")
    with pytest.raises(backend.BackendError, match="EMBER_BACKEND=cupy"):
        backend.get_backend_name()


def test_unknown_backend_is_rejected(monkeypatch):
    monkeypatch.setenv("EMBER_BACKEND", "tpu")
    with pytest.raises(backend.BackendError, match="tpu"):
        backend.get_backend_name()


def test_the_process_malloc_policy_can_be_left_alone(monkeypatch):
    """keep_freed_memory_mapped is process-wide (mallopt); EMBER_KEEP_FREED_MEMORY=0 opts out."""
    from ember_cupy.backend import keep_freed_memory_mapped
    monkeypatch.setenv("EMBER_KEEP_FREED_MEMORY", "0")
    assert keep_freed_memory_mapped() is False
    monkeypatch.delenv("EMBER_KEEP_FREED_MEMORY")
    assert keep_freed_memory_mapped() is True   # glibc on Linux accepts the settings
