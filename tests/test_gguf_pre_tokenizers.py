"""GGUF byte-level BPE pre-tokenizers follow llama.cpp's definitions (src/llama-vocab.cpp): the
splits of our tokenizers-regex sequence equal those of llama.cpp's own (adapted) regexes applied
one after the other, as its unicode_regex_split does; llama3's ignore_merges; unknown names
refused (see also test_gguf_families.py)."""
import gguf
import pytest
import regex
from tokenizers import Regex, pre_tokenizers

from ember_cupy.gguf_vocab import pre_tokenizer_kind
from ember_cupy.tokenizer import Tokenizer

# llama.cpp's regex lists, copied from llama-vocab.cpp (its std::regex-friendly forms).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA_CPP = {
    "llama-bpe": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen2": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "gpt-2": [_GPT2],
    "olmo": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "starcoder": [r"\p{N}", _GPT2],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"],
    "tekken": [r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "gpt-4o": [r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS
               + r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS
               + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "bloom": [r" ?[^(\s|.,!?…。，、।۔،)]+"],
}
TEXTS = [
    "Hello WORLD, it's 12345 dollars!\n\n  don't   CamelCaseWord HTTPServer iPhone",
    "日本語のテキスト 中文 한국어 ÀÉÎ ñandú 3.14159 ok?! \t\r\n  x",
    "def f(x):\n    return x**2  # sq\n\n\nclass A_b(c): pass",
    "I'M WE'LL THEY'D 1,234,567 2024-06-30 $100 +5 <=> ^~|` a/b/c",
    "   leading and trailing   ",
]


def _reference_split(text: str, patterns: list[str]) -> list[str]:
    pieces = [text]
    for pattern in patterns:
        out = []
        for piece in pieces:
            at = 0
            for match in regex.finditer(pattern, piece):
                if match.start() > at:
                    out.append(piece[at:match.start()])
                if match.end() > match.start():
                    out.append(match.group())
                at = match.end()
            if at < len(piece):
                out.append(piece[at:])
        pieces = out
    return pieces


@pytest.mark.parametrize("name", sorted(LLAMA_CPP))
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_splits_equal_llama_cpp_regexes(name, text):
    regexes, _ = pre_tokenizer_kind(name)
    ours = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes])
    assert [piece for piece, _ in ours.pre_tokenize_str(text)] == _reference_split(text, LLAMA_CPP[name])


def _bpe_file(path, pre: str) -> str:
    tokens = ["<s>", "a", "b", "c", "ab", "abc"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * 5)
    writer.add_token_merges(["a b"])      # no merge makes "abc": only ignore_merges finds it
    writer.add_bos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("pre,expected,bos", [("llama-bpe", ["abc"], True), ("gpt-2", ["ab", "c"], False)])
def test_llama3_ignores_merges_for_whole_words(tmp_path, pre, expected, bos):
    tok = Tokenizer.from_gguf(gguf.GGUFReader(_bpe_file(tmp_path / "v.gguf", pre)))
    assert [tok.id_to_token(i) for i in tok.encode("abc", add_special_tokens=False)] == expected
    assert tok.add_bos_token == bos   # llama.cpp: llama3 adds BOS when the file does not say


def test_deepseek_llm_letters_are_llama_cpps_ranges():
    """Its letter class spells U+1F7D, U+1FBE, U+1FD3, U+1FDB, U+2126 and U+212A (KELVIN SIGN):
    NFC-normalized source once turned them into other characters, an empty range (no such file
    loaded) and a 'K-ℭ' range that took ASCII punctuation for letters."""
    regexes, _ = pre_tokenizer_kind("deepseek-llm")
    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes])
    assert [piece for piece, _ in split.pre_tokenize_str("Kab[c]\u212a\u1f7d")] == ["Kab", "[", "c", "]", "\u212a\u1f7d"]
