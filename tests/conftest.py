import os
import shutil
import tempfile

import pytest

os.environ.setdefault("EMBER_BACKEND", "numpy")
# packed weights kept for this session only (ember_cupy/model/weight_cache.py), servers spawned included
_WEIGHT_CACHE = tempfile.mkdtemp(prefix="ember-weight-cache-")
os.environ.setdefault("EMBER_WEIGHT_CACHE", _WEIGHT_CACHE)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_WEIGHT_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def checkpoint():
    """The default model (SmolLM2-135M-Instruct Q4_1), loaded once per test session."""
    from ember_cupy.model.loader import load_checkpoint
    return load_checkpoint(None)


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    return checkpoint.tokenizer


@pytest.fixture
def make_llm(checkpoint):
    """LLM on the shared checkpoint with any EngineConfig fields."""
    from ember_cupy import LLM
    return lambda **config: LLM(checkpoint, **config)
