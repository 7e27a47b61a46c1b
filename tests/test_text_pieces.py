"""Long texts are tokenized in pieces (ember_cupy/text_pieces.py) to the same ids as the whole
text, for every byte-level pre-tokenizer the GGUF files use; tokenizers where a cut could change
the ids are never cut."""
import random

import pytest
from tokenizers import Regex, Tokenizer as HFTokenizer, models, normalizers, pre_tokenizers, processors

from ember_cupy import text_pieces
from ember_cupy.gguf_vocab import SUPPORTED_PRE_TOKENIZERS, pre_tokenizer_kind
from ember_cupy.tokenizer import Tokenizer

WORDS = ["Hello", "WORLD,", "it's", "12345", "dollars!\n\n", "  don't", "   CamelCaseWord", "HTTPServer",
         "iPhone", "日本語の", "テキスト", "ñandú", "3.14159", "ok?!", "\t\r\n", "x", "def f(x):\n    return",
         "I'M", "we'LL", "$100", "+5", "<=>", "^~|`", "a/b/c", "<|im_end|>", "<|im_start|>user\n", "🚀🔥",
         "é", "\u00a0", "   ", "--", "a b", "Z"]


def mixed_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(WORDS) + rng.choice([" ", " ", "", "\n", "  "]) for _ in range(words))


def test_a_long_text_is_cut_and_tokenizes_to_the_ids_of_the_whole(tokenizer, monkeypatch):
    assert tokenizer._cuts_safely
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", 40)
    for seed in range(20):
        text = mixed_text(seed, 300)
        assert len(text_pieces.cut_points(text)) > 10
        for specials in (True, False):
            assert tokenizer.encode(text, specials) == tokenizer._encode(text, specials), seed


def test_a_4_mb_text_is_cut_into_pieces_of_piece_chars(tokenizer):
    text = "lorem ipsum dolor " * (4_000_000 // 18)
    cuts = text_pieces.cut_points(text)
    assert len(cuts) == len(text) // text_pieces.PIECE_CHARS
    assert all(text[c - 1].isalpha() and text[c] == " " and text[c + 1].isalpha() for c in cuts)
    assert tokenizer.encode(text[:300_000]) == tokenizer._encode(text[:300_000], False)


@pytest.mark.parametrize("pre", SUPPORTED_PRE_TOKENIZERS)
def test_every_gguf_pre_tokenizer_splits_at_each_cut(pre):
    """Byte-level BPE works within the pre-tokenizer's pieces: pieces of the cut text, put
    together, are the pieces of the whole, so the ids are too."""
    regexes, _ = pre_tokenizer_kind(pre)
    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
                                    + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    for seed in range(10):
        text = mixed_text(seed, 200)
        cuts = text_pieces.cut_points(text, 30)
        assert len(cuts) > 5
        joined = []
        for start, end in zip([0, *cuts], [*cuts, len(text)]):
            joined += [piece for piece, _ in split.pre_tokenize_str(text[start:end])]
        assert joined == [piece for piece, _ in split.pre_tokenize_str(text)], (pre, seed)


def _bpe(normalizer=None, prefix_space=False, post_processor=None) -> HFTokenizer:
    hf = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate("abcdĠ")}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    hf.normalizer = normalizer
    hf.post_processor = post_processor
    return hf


def test_tokenizers_a_cut_could_change_are_never_cut():
    assert text_pieces.cuts_safely(_bpe())
    assert text_pieces.cuts_safely(_bpe(normalizers.NFC()))
    assert not text_pieces.cuts_safely(_bpe(normalizers.Lowercase()))
    assert not text_pieces.cuts_safely(_bpe(prefix_space=True))
    spaced = _bpe()
    spaced.add_tokens(["a b"])
    assert not text_pieces.cuts_safely(spaced)
    sentencepiece = HFTokenizer(models.BPE(vocab={"a": 0, "\u2581": 1}, merges=[]))
    sentencepiece.normalizer = normalizers.Replace(" ", "\u2581")
    assert not text_pieces.cuts_safely(sentencepiece)


def test_special_tokens_of_a_post_processor_wrap_the_whole_cut_text(monkeypatch):
    wrap = processors.TemplateProcessing(single="c $A d", special_tokens=[("c", 2), ("d", 3)])
    tok = Tokenizer(_bpe(post_processor=wrap), bos_token_id=2, eos_token_ids=(3,), add_bos_token=True,
                    chat_template=None, post_processor_adds=True)
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", 4)
    text = " ".join(["ab", "ba", "a", "bb"] * 20)
    assert len(text_pieces.cut_points(text)) > 5
    assert tok.encode(text) == tok._encode(text, True)
    assert tok.encode(text)[0] == 2 and tok.encode(text)[-1] == 3
    assert tok.encode(text, add_special_tokens=False) == tok._encode(text, False)
