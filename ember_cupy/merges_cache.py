"""SentencePiece merges ranked once per vocabulary and kept on disk.

Ranking every split of every piece (gguf_vocab._merges_by_score) is most of the time it takes
to load a model with a large SentencePiece vocabulary: about a second for Gemma 3's 262k pieces,
against llama-server's whole load of about one. The ranking depends only on the pieces, their
types and their scores, so it is kept as a .npy of [merges, 2] int32 ids under a hash of those
($EMBER_TOKENIZER_CACHE, default ~/.cache/ember_cupy/merges). A file that is missing, unreadable
or does not fit the vocabulary is ranked again; a cache that cannot be written is skipped.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Callable

import numpy as np

logger = logging.getLogger(__name__)
_FORMAT = b"ember-merges-1"


def cache_dir() -> Path:
    return Path(os.environ.get("EMBER_TOKENIZER_CACHE", Path.home() / ".cache" / "ember_cupy" / "merges"))


def vocabulary_key(tokens: list[str], types: list[int], scores: list[float]) -> str:
    digest = hashlib.sha256(_FORMAT)
    digest.update("\0".join(tokens).encode("utf-8", "surrogatepass"))
    digest.update(np.asarray(types, dtype=np.int32).tobytes())
    digest.update(np.asarray(scores, dtype=np.float32).tobytes())
    return digest.hexdigest()[:32]


def cached_merges(tokens: list[str], types: list[int], scores: list[float],
                  rank: Callable[[], np.ndarray]) -> np.ndarray:
    """rank()'s [merges, 2] ids, from the cache when this vocabulary was ranked before."""
    path = cache_dir() / f"{vocabulary_key(tokens, types, scores)}.npy"
    ranked = _read(path, len(tokens))
    if ranked is None:
        ranked = rank()
        _write(path, ranked)
    return ranked


def _read(path: Path, vocab_size: int) -> np.ndarray | None:
    try:
        ranked = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    if ranked.dtype != np.int32 or ranked.ndim != 2 or ranked.shape[1] != 2:
        return None
    if ranked.size and (ranked.min() < 0 or ranked.max() >= vocab_size):
        return None
    return ranked


def _write(path: Path, ranked: np.ndarray) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(tmp, np.ascontiguousarray(ranked, dtype=np.int32))
        os.replace(tmp, path)
    except OSError as error:
        logger.debug("merges cache not written (%s): %s", path, error)
        tmp.unlink(missing_ok=True)
