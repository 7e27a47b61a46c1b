"""Long texts cut into pieces that tokenize to the same ids as the whole.

Why: `tokenizers` turns one text into one Encoding (ids, offsets, token strings, masks: ~170
bytes a token). For a 4 MB text that is 1.5M tokens, ~260 MB, and building its id list and
freeing it hold Python's GIL for ~0.15 s at a stretch, so the server's event loop and engine
stall behind a single large /tokenize or prompt. Piece by piece the same work holds the GIL a
millisecond at a time and never keeps more than one piece's Encoding.

Where a cut is safe: byte-level BPE never merges across its pre-tokenizer's pieces, and every
pre-tokenizer regex in use (GPT-2, Llama 3, Qwen2, StarCoder, ... : `gguf_vocab`) starts a new
piece at a space that follows a letter and precedes one ("abc def" -> "abc", " def"). So a cut
just before such a space changes nothing, provided no normalizer rewrites across it (none, or NFC)
and no added token holds a space (added tokens are matched before pre-tokenization). SentencePiece
tokenizers (a normalizer that escapes spaces, merges that may cross words) are never cut.
"""
from __future__ import annotations

import json
import re

PIECE_CHARS = 1 << 14      # texts longer than this are tokenized in pieces of about this size

# A cut goes just before the space of "<letter> <letter>" (ASCII letters: their class is the same
# in every regex above).
_CUT_BEFORE = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")

_SAFE_NORMALIZERS = (None, "NFC")


def cuts_safely(hf) -> bool:
    """Whether `hf` (a tokenizers.Tokenizer) tokenizes text cut at `cut_points` as it does the
    whole: byte-level BPE without a prefix space, no normalizer but NFC, no added token with a
    space, and its pre-tokenizer splitting "ab cd" into "ab" and " cd"."""
    normalizer = _spec(hf.normalizer) or {}
    if normalizer.get("type") not in _SAFE_NORMALIZERS:
        return False
    if type(hf.model).__name__ != "BPE" or not _is_byte_level(_spec(hf.pre_tokenizer)):
        return False
    if any(" " in token.content for token in hf.get_added_tokens_decoder().values()):
        return False
    pieces = [offsets for _, offsets in hf.pre_tokenizer.pre_tokenize_str("ab cd")]
    return pieces == [(0, 2), (2, 5)]


def _spec(component) -> dict | None:
    """A tokenizer component's settings as its JSON gives them (None for no component)."""
    return None if component is None else json.loads(component.__getstate__())


def _is_byte_level(pre_tokenizer: dict | None) -> bool:
    """A ByteLevel pre-tokenizer without a prefix space, alone or after Split regexes."""
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        steps = pre_tokenizer.get("pretokenizers") or []
        return (bool(steps) and all(step.get("type") == "Split" for step in steps[:-1])
                and _is_byte_level(steps[-1]))
    return pre_tokenizer.get("type") == "ByteLevel" and not pre_tokenizer.get("add_prefix_space", False)


def cut_points(text: str, piece_chars: int | None = None) -> list[int]:
    """Offsets at which to cut `text` into pieces of at least piece_chars (default PIECE_CHARS)
    characters (the last one may be shorter); [] when the text is short or has no safe place to cut."""
    piece_chars = piece_chars or PIECE_CHARS
    points = []
    start = piece_chars
    while start < len(text) - 1:
        match = _CUT_BEFORE.search(text, start)
        if match is None:
            break
        points.append(match.start())
        start = match.start() + piece_chars
    return points
