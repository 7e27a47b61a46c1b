"""llguidance's tokenizer built from ember's own: every token's bytes and an encode callback.

llguidance can also build its tokenizer from the `tokenizers` JSON, but then it parses a second
`tokenizers` instance of its own and keeps it. Measured after malloc_trim in a fresh process:
SmolLM2's 49k vocabulary +33 MB anonymous memory and 0.27 s that way, +16 MB and 0.23 s this way
(a sixth of what the server holds besides its weights); Gemma 3's 262k +218 MB and 2.8 s against
+101 MB and 1.6 s. Handed the bytes of each token (what its token trie is made of) and a
function that encodes text, it builds the trie alone; the text it encodes (forced tokens after a
grammar's fixed text) goes through the tokenizer the engine already has.
"""
from __future__ import annotations

import llguidance

# How llguidance tells a special token's bytes from text: they start with this byte, never the
# first of a UTF-8 character (its JSON loader writes special added tokens so too).
SPECIAL_TOKEN_MARK = b"\xff"


class _TokenizerView:
    """What llguidance reads from a Python tokenizer (the attributes of its TokenizerWrapper)."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer, vocab_size: int):
        self.tokens = token_bytes_for_llguidance(tokenizer, vocab_size)
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [i for i, b in enumerate(self.tokens) if b.startswith(SPECIAL_TOKEN_MARK)]
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def token_bytes_for_llguidance(tokenizer, vocab_size: int) -> list[bytes]:
    """Token i's bytes for i < vocab_size: a special token's text after SPECIAL_TOKEN_MARK (an
    added token written as <...> counts as special, as llguidance's own loaders take it); an id
    the vocabulary does not fill (logits wider than the vocabulary) is the special "<[i]>", as
    llguidance's JSON loader names it."""
    tokens = tokenizer.tokens_bytes(range(vocab_size))
    for token_id, piece in enumerate(tokens):
        if not piece and tokenizer.id_to_token(token_id) is None:
            tokens[token_id] = SPECIAL_TOKEN_MARK + f"<[{token_id}]>".encode()
    for token_id, (text, special) in tokenizer.added_tokens().items():
        if token_id < vocab_size and (special or _looks_like_control(text)):
            tokens[token_id] = SPECIAL_TOKEN_MARK + text.encode("utf-8")
    return tokens


def build_ll_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """tokenizer: ember_cupy.tokenizer.Tokenizer; vocab_size: the width of the model's logits."""
    return llguidance.LLTokenizer(_TokenizerView(tokenizer, vocab_size), n_vocab=vocab_size,
                                  eos_token=list(tokenizer.eos_token_ids))


def _looks_like_control(text: str) -> bool:
    return text.startswith("<") and text.endswith(">")
