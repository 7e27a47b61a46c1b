"""SentencePiece GGUF vocabularies (tokenizer.ggml.model = "llama") tokenize as llama.cpp does:
the Gemma 3 270M file's 262k pieces with scores and byte fallback, against llama.cpp's own ids
(tests/fixtures/gemma3_spm_tokens.json, made by tools/make_spm_fixture.py); and a small vocabulary
written here, for the merge order, byte fallback and the leading-space rule without the file."""
import json
import os

import gguf
import pytest

from ember_cupy.model.gguf_loader import _open_reader
from ember_cupy.tokenizer import Tokenizer
from gemma3_model import gemma3_gguf_path

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "gemma3_spm_tokens.json")
CASES = json.load(open(FIXTURE))["cases"]


@pytest.fixture(scope="module")
def gemma_tokenizer():
    return Tokenizer.from_gguf(_open_reader(gemma3_gguf_path()))


def test_fixture_has_enough_tricky_strings():
    assert len(CASES) >= 40


@pytest.mark.parametrize("case", CASES, ids=[repr(c["text"])[:40] for c in CASES])
def test_ids_equal_llama_cpp(gemma_tokenizer, case):
    assert gemma_tokenizer.encode(case["text"], add_special_tokens=False) == case["ids"]


def test_bos_is_added_once_and_special_tokens_are_special(gemma_tokenizer):
    tok = gemma_tokenizer
    assert tok.add_bos_token and tok.bos_token_id == 2
    assert tok.encode("Hi") == [2] + tok.encode("Hi", add_special_tokens=False)
    turn = tok.encode("<end_of_turn>", add_special_tokens=False)
    assert len(turn) == 1 and turn[0] in tok.eos_token_ids


@pytest.mark.parametrize("text", ["Hello  world 😀\n", "naïve café 日本語", "  x\ty\n\n", "\x00\x7f"])
def test_decode_round_trips(gemma_tokenizer, text):
    assert gemma_tokenizer.decode(gemma_tokenizer.encode(text)) == text


def test_byte_fallback_tokens_give_their_bytes(gemma_tokenizer):
    ids = gemma_tokenizer.encode("\ue000", add_special_tokens=False)   # not a piece: UTF-8 bytes
    assert b"".join(gemma_tokenizer.token_bytes(i) for i in ids) == "\ue000".encode()


# --- a small SentencePiece vocabulary, no file needed -----------------------------------------
def _write_spm(path, add_space_prefix: bool) -> str:
    pieces = ["<unk>", "<s>", "</s>", "▁", "a", "b", "c", "ab", "bc", "abc", "▁a", "▁ab", "▁abc"]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -2.0, -5.0, -3.0, -4.0, -6.0, -7.0, -1.0]   # bc outranks ab
    types = [2, 3, 3] + [1] * (len(pieces) - 3)
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    scores += [0.0] * 256
    types += [6] * 256
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return str(path)


def _small(tmp_path, add_space_prefix=True) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(_write_spm(tmp_path / "spm.gguf", add_space_prefix)))


def test_highest_scoring_merge_wins(tmp_path):
    """"abc" without a space: b+c (score -3) merges before a+b (-5), then a+bc -> abc."""
    tok = _small(tmp_path, add_space_prefix=False)
    pieces = [tok.id_to_token(i) for i in tok.encode("abc", add_special_tokens=False)]
    assert pieces == ["abc"]
    assert [tok.id_to_token(i) for i in tok.encode("bca", add_special_tokens=False)] == ["bc", "a"]


def test_space_prefix_and_byte_fallback(tmp_path):
    tok = _small(tmp_path)
    assert tok.add_bos_token   # SentencePiece files add BOS unless they say otherwise
    ids = tok.encode("abc d")
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "▁abc", "▁", "<0x64>"]
    assert tok.decode(ids) == "abc d"


def test_merges_are_ranked_once_per_vocabulary(tmp_path, monkeypatch):
    """The second build of the same vocabulary reads the ranking from the cache (ranking again
    would raise here) and tokenizes the same."""
    from ember_cupy import gguf_vocab
    monkeypatch.setenv("EMBER_TOKENIZER_CACHE", str(tmp_path / "cache"))
    first = _small(tmp_path, add_space_prefix=False)
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1
    monkeypatch.setattr(gguf_vocab, "_merges_by_score", lambda *a: (_ for _ in ()).throw(AssertionError("ranked")))
    again = _small(tmp_path, add_space_prefix=False)
    for text in ("abc", "bca", "cab abc"):
        assert again.encode(text) == first.encode(text)


@pytest.mark.parametrize("damage", ["garbage", "ids past the vocabulary", "wrong shape"])
def test_a_damaged_merges_cache_is_ranked_again(tmp_path, monkeypatch, damage):
    import numpy as np
    monkeypatch.setenv("EMBER_TOKENIZER_CACHE", str(tmp_path / "cache"))
    reference = _small(tmp_path, add_space_prefix=False)
    (cached,) = (tmp_path / "cache").glob("*.npy")
    if damage == "garbage":
        cached.write_bytes(b"not a numpy file")
    else:
        bad = np.full((4, 2), 10**6, np.int32) if damage.startswith("ids") else np.zeros((4, 3), np.int32)
        np.save(cached, bad)
    tok = _small(tmp_path, add_space_prefix=False)
    assert [tok.id_to_token(i) for i in tok.encode("abc", add_special_tokens=False)] == ["abc"]
    assert tok.encode("bca cab") == reference.encode("bca cab")
