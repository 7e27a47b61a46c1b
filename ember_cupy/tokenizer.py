"""Tokenizer on the `tokenizers` package: from tokenizer.json or a GGUF's embedded vocabulary."""
from __future__ import annotations

import functools
import os
import re

from tokenizers import decoders
from tokenizers import Tokenizer as _HFTokenizer

from ember_cupy import text_pieces
from ember_cupy.chat_template import ChatTemplate
from ember_cupy.gguf_vocab import CONTROL, SPACE, adds_bos, build_gguf_tokenizer
from ember_cupy.json_file import read_json_object

# Tokens that end generation when the model emits them (llama.cpp's EOG set, by text).
EOG_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",
             "</s>", "<end_of_turn>", "<|end|>")


class Tokenizer:
    """Text <-> token ids, special tokens, EOS set and chat template of one model."""

    def __init__(self, hf: _HFTokenizer, *, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 add_bos_token: bool, chat_template: str | None, post_processor_adds: bool = False):
        """post_processor_adds: hf's own post-processor adds the special tokens (a tokenizer.json
        with e.g. a TemplateProcessing BOS); else BOS is added here when add_bos_token."""
        self._hf = hf
        self._post_processor_adds = post_processor_adds
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.add_bos_token = add_bos_token
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self._special_ids = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        self._specials_around = _post_processor_specials(hf) if post_processor_adds else ((), ())
        self._cuts_safely = text_pieces.cuts_safely(hf) and self._specials_around is not None
        self.set_chat_template(chat_template)

    def set_chat_template(self, source: str | None) -> None:
        """The chat template's Jinja source (None: no template)."""
        token_text = lambda i: None if i is None else self._hf.id_to_token(i)  # noqa: E731
        self.chat_template = ChatTemplate(
            source, bos_token=token_text(self.bos_token_id) or "",
            eos_token=token_text(self.eos_token_ids[0] if self.eos_token_ids else None) or "",
        ) if source else None

    def __len__(self) -> int:
        return self.vocab_size

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        from ember_cupy.gguf_metadata import field_value
        hf = build_gguf_tokenizer(reader)
        tokens = field_value(reader, "tokenizer.ggml.tokens")
        types = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        eos = field_value(reader, "tokenizer.ggml.eos_token_id")
        eot = field_value(reader, "tokenizer.ggml.eot_token_id")
        eog = [i for i in (eos, eot) if i is not None]
        eog += [i for i, t in enumerate(tokens) if types[i] == CONTROL and t in EOG_TEXTS]
        return cls(hf, bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
                   eos_token_ids=tuple(eog), add_bos_token=adds_bos(reader),
                   chat_template=field_value(reader, "tokenizer.chat_template"))

    @classmethod
    def from_hf_directory(cls, path: str, eos_token_ids: tuple[int, ...] = ()) -> "Tokenizer":
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        try:
            hf = _HFTokenizer.from_file(tokenizer_file)
        except Exception as exc:   # the tokenizers library raises a bare Exception
            raise ValueError(f"{tokenizer_file}: not a tokenizer the tokenizers library can read ({exc})") from None
        config_file = os.path.join(path, "tokenizer_config.json")
        config = read_json_object(config_file) if os.path.isfile(config_file) else {}
        specials = hf.encode("", add_special_tokens=True).ids   # what the post-processor adds
        token_id = lambda text: None if text is None else hf.token_to_id(_content(text))  # noqa: E731
        eog = list(eos_token_ids) + [token_id(config.get("eos_token"))]
        eog += [i for i, t in hf.get_added_tokens_decoder().items() if t.special and t.content in EOG_TEXTS]
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        bos = token_id(config.get("bos_token"))
        if bos is None and specials:
            bos = specials[0]
        return cls(hf, bos_token_id=bos, eos_token_ids=tuple(i for i in eog if i is not None),
                   add_bos_token=bool(specials[:1] == [bos]) if specials else bool(config.get("add_bos_token", False)),
                   chat_template=template, post_processor_adds=bool(specials))

    # --- use ----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens: the model's BOS (as its tokenizer config says); False for a prompt
        apply_chat_template rendered, whose template wrote them already (as vLLM encodes chat)."""
        if not isinstance(text, str):
            raise ValueError(f"text to tokenize must be a string, got {type(text).__name__}")
        by_post_processor = add_special_tokens and self._post_processor_adds
        cuts = text_pieces.cut_points(text) if self._cuts_safely else []
        ids = self._encode_pieces(text, cuts, by_post_processor) if cuts else self._encode(text, by_post_processor)
        if (add_special_tokens and not self._post_processor_adds and self.add_bos_token
                and self.bos_token_id is not None):
            ids = [self.bos_token_id] + ids
        return ids

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:   # encode_batch releases the GIL while it works (encode does not): a 4 MB prompt
            # tokenized in a worker thread leaves the server's event loop free meanwhile
            return self._hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:   # what `tokenizers` raises for a str it cannot convert to UTF-8
            check_unicode(text)
            raise

    def _encode_pieces(self, text: str, cuts: list[int], add_special_tokens: bool) -> list[int]:
        """A long text's ids, piece by piece (text_pieces: same ids, a fraction of the memory
        and of the GIL held at a time), inside the special tokens the post-processor adds."""
        before, after = self._specials_around if add_special_tokens else ((), ())
        ids = list(before)
        for start, end in zip([0, *cuts], [*cuts, len(text)]):
            ids += self._encode(text[start:end], add_special_tokens=False)
        ids += after
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def vocabulary(self) -> dict[str, int]:
        """Every token's text -> its id, added tokens included."""
        return self._hf.get_vocab(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self._hf.id_to_token(int(token_id))

    def added_tokens(self) -> dict[int, tuple[str, bool]]:
        """The tokens added beside the model's vocabulary (control tokens such as BOS, EOS, chat
        markers, and user-defined ones): id -> (text, whether special)."""
        return {i: (t.content, t.special) for i, t in self._hf.get_added_tokens_decoder().items()}

    def token_bytes_text(self, token_id: int) -> str:
        """The token's own text, as in logprobs entries (may be a partial UTF-8 sequence)."""
        return self._hf.decode([int(token_id)], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's raw bytes, as its decoder produces them: for byte-level BPE the bytes its
        characters stand for, even when they are only part of a UTF-8 character (where
        token_bytes_text shows U+FFFD); b"" for an id the vocabulary does not have."""
        return self.tokens_bytes([token_id])[0]

    def tokens_bytes(self, token_ids) -> list[bytes]:
        """token_bytes of each id; the pieces that only the decoder can spell are decoded in one
        call (a whole vocabulary: Gemma 3's 262k pieces, for llguidance's token trie)."""
        byte_level = isinstance(self._hf.decoder, decoders.ByteLevel)
        out = [_piece_bytes(self._hf.id_to_token(int(i)), byte_level) for i in token_ids]
        spelled = [k for k, piece in enumerate(out) if piece is None]
        if spelled:
            texts = self._hf.decode_batch([[int(token_ids[k])] for k in spelled], skip_special_tokens=False)
            for k, text in zip(spelled, texts):
                out[k] = text.encode("utf-8")
        return out

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tokenize: bool = False, **extra) -> str | list[int]:
        """The conversation as the model's prompt text, its special tokens written by the template:
        encode it with add_special_tokens=False. tokenize=True: those token ids instead (as the
        transformers tokenizer's, whose default is True; here the text is the default)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use a plain completion prompt")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False) if tokenize else text


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")   # SentencePiece's piece for one byte


def _piece_bytes(token: str | None, byte_level: bool) -> bytes | None:
    """A vocabulary piece's bytes where the piece itself says them; None where the decoder must."""
    if token is None:
        return b""
    if byte_level:
        table = _byte_level_decoder()
        if all(c in table for c in token):
            return bytes(table[c] for c in token)
        return token.encode("utf-8")   # as the ByteLevel decoder: a token outside its alphabet is its own text
    byte = _BYTE_FALLBACK.fullmatch(token)
    if byte:
        return bytes([int(byte.group(1), 16)])
    if SPACE in token:   # a SentencePiece piece: its decoder may strip a leading space
        return token.replace(SPACE, " ").encode("utf-8")
    return None


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for U+0100 onwards, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


def _post_processor_specials(hf) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ids hf's post-processor puts before and after a text (None: not a plain wrap)."""
    bare = hf.encode("a", add_special_tokens=False).ids
    wrapped = hf.encode("a", add_special_tokens=True).ids
    for start in range(len(wrapped) - len(bare) + 1):
        if wrapped[start:start + len(bare)] == bare:
            return tuple(wrapped[:start]), tuple(wrapped[start + len(bare):])
    return None


def check_unicode(text: str) -> None:
    """ValueError if text holds a lone UTF-16 surrogate (e.g. from the JSON escape "\\ud800"):
    it has no UTF-8 form, so no tokenizer can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text contains a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x}) at "
                         f"character {exc.start}: it must be valid Unicode") from None


def _content(token) -> str:
    return token["content"] if isinstance(token, dict) else token
