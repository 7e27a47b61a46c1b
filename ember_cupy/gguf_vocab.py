"""A GGUF file's embedded vocabulary as a `tokenizers.Tokenizer`, tokenizing as llama.cpp does.

Two vocabulary kinds (`tokenizer.ggml.model`):
  gpt2   byte-level BPE with merges, split first by the pre-tokenizer named in
         `tokenizer.ggml.pre` (llama.cpp's llama-vocab.cpp definitions; an unknown name is refused,
         never guessed);
  llama  SentencePiece (Llama-2, Mistral v0.1, TinyLlama, Gemma): pieces with scores and
         byte-fallback tokens <0xXX>. llama.cpp merges the adjacent pair whose joined text is a
         piece of highest score; a BPE whose merge ranks follow the joined piece's score does the
         same, as transformers' SentencePiece converter builds it.
"""
from __future__ import annotations

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ember_cupy.gguf_metadata import field_value
from ember_cupy.merges_cache import cached_merges

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_LLM = [
    r"[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
]

# tokenizer.ggml.pre -> (regexes applied one after the other, ignore_merges), from llama.cpp.
_PRE_TOKENIZER_KINDS = {
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], False),
    "llama3": ([_LLAMA3], True),
    "smaug": ([_LLAMA3], False),
    "gpt2": ([_GPT2], False),
    "starcoder": ([r"\p{N}", _GPT2], False),
    "qwen2": ([_QWEN2], False),
    "deepseek-llm": (_DEEPSEEK_LLM, False),
    "deepseek-coder": ([r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"], False),
    "falcon": ([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"], False),
    "tekken": ([_TEKKEN], True),
    "gpt-4o": ([_GPT4O], False),
    "chatglm4": ([_LLAMA3], False),
    "glm4": ([_LLAMA3], True),
    "bloom": ([r" ?[^(\s|.,!?…。，、।۔،)]+"], False),
    "viking": ([r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"], False),
}
_PRE_TOKENIZER_ALIASES = {
    "llama-bpe": "llama3", "llama-v3": "llama3", "falcon3": "llama3", "pixtral": "llama3",
    "smaug-bpe": "smaug", "dbrx": "smaug",
    "gpt-2": "gpt2", "phi-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2",
    "roberta-bpe": "gpt2", "exaone4": "gpt2", "trillion": "gpt2",
    "smollm": "starcoder", "refact": "starcoder", "command-r": "starcoder",
    "codeshell": "starcoder", "exaone": "starcoder", "minerva-7b": "starcoder",
    "deepseek-r1-qwen": "qwen2", "stablelm2": "qwen2", "megrez": "qwen2", "hunyuan": "qwen2",
    "llama4": "gpt-4o", "chatglm-bpe": "chatglm4", "glm5": "glm4",
    "poro-chat": "bloom", "gpt3-finnish": "bloom",
}
SUPPORTED_PRE_TOKENIZERS = tuple(sorted({*_PRE_TOKENIZER_KINDS, *_PRE_TOKENIZER_ALIASES}))


def pre_tokenizer_kind(pre: str | None) -> tuple[list[str], bool]:
    """llama.cpp's regexes and ignore_merges flag for a `tokenizer.ggml.pre` value."""
    name = pre or "default"   # llama.cpp: a file without one gets the default (and a warning)
    name = _PRE_TOKENIZER_ALIASES.get(name, name)
    if name not in _PRE_TOKENIZER_KINDS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (it would tokenize differently "
                         f"from llama.cpp); supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}")
    return _PRE_TOKENIZER_KINDS[name]


# Pre-tokenizer kinds after which llama.cpp adds BOS when the file does not say.
_ADD_BOS_BY_DEFAULT = ("llama3", "tekken")


def adds_bos(reader) -> bool:
    """llama.cpp's add_bos: tokenizer.ggml.add_bos_token when the file has it, else true for
    SentencePiece and the llama3/tekken pre-tokenizers, false otherwise."""
    explicit = field_value(reader, "tokenizer.ggml.add_bos_token")
    if explicit is not None:
        return bool(explicit)
    if field_value(reader, "tokenizer.ggml.model") == "llama":
        return True
    pre = field_value(reader, "tokenizer.ggml.pre") or "default"
    return _PRE_TOKENIZER_ALIASES.get(pre, pre) in _ADD_BOS_BY_DEFAULT


def build_gguf_tokenizer(reader) -> HFTokenizer:
    """The file's vocabulary, pre-tokenization and special tokens as a `tokenizers.Tokenizer`."""
    kind = field_value(reader, "tokenizer.ggml.model")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{getattr(reader, 'path', 'the GGUF file')}: its metadata tokenizer.ggml.tokens is "
                         "missing or not a list of strings: no vocabulary to tokenize with")
    types = field_value(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        raise ValueError(f"{getattr(reader, 'path', 'the GGUF file')}: tokenizer.ggml.token_type holds "
                         f"{len(types) if isinstance(types, list) else types!r} entries for {len(tokens)} tokens")
    if kind == "gpt2":
        hf = _byte_level_bpe(reader, tokens)
    elif kind == "llama":
        hf = _sentencepiece(reader, tokens, types)
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported "
                         "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
    hf.add_tokens([AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
                   for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)])
    return hf


def _byte_level_bpe(reader, tokens: list[str]) -> HFTokenizer:
    regexes, ignore_merges = pre_tokenizer_kind(field_value(reader, "tokenizer.ggml.pre"))
    merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges") or []]
    hf = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                fuse_unk=False, ignore_merges=ignore_merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    return hf


SPACE = "\u2581"   # SentencePiece's visible space


def _sentencepiece(reader, tokens: list[str], types: list[int]) -> HFTokenizer:
    scores = field_value(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = dict(zip(tokens, range(len(tokens))))
    unk = next((tokens[i] for i, t in enumerate(types) if t == UNKNOWN), None)
    ranked = cached_merges(tokens, types, scores, lambda: _merges_by_score(tokens, types, scores, vocab))
    # the pieces by id as one object array: fancy indexing builds the 515k pairs of Gemma 3 in
    # 0.13 s, where a tuple per row of ranked.tolist() took 0.42 s of every load
    pieces = np.array(tokens, dtype=object)
    merges = list(zip(pieces[ranked[:, 0]].tolist(), pieces[ranked[:, 1]].tolist()))
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges,
                                unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_space_prefix = bool(field_value(reader, "tokenizer.ggml.add_space_prefix", True))
    escape = normalizers.Replace(" ", SPACE)
    hf.normalizer = (normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if add_space_prefix
                     else escape)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    hf.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return hf


def _merges_by_score(tokens, types, scores, vocab) -> np.ndarray:
    """Every split of a mergeable piece into two pieces, ranked by the joined piece's score
    (highest first; ties by id, then by the left piece's id): the order in which llama.cpp's
    SentencePiece merges them, as [merges, 2] ids of the left and right pieces. One pass over the
    pieces and a NumPy sort (Gemma 3's 262k pieces have 515k splits)."""
    owners, lefts, rights = [], [], []
    for i, piece in enumerate(tokens):
        if len(piece) < 2 or types[i] not in (NORMAL, USER_DEFINED):
            continue
        for cut in range(1, len(piece)):
            left = vocab.get(piece[:cut])
            if left is not None:
                right = vocab.get(piece[cut:])
                if right is not None:
                    owners.append(i)
                    lefts.append(left)
                    rights.append(right)
    owners = np.asarray(owners, dtype=np.int64)
    pairs = np.stack([np.asarray(lefts, dtype=np.int32), np.asarray(rights, dtype=np.int32)], axis=1)
    order = np.lexsort((pairs[:, 0], owners, -np.asarray(scores, dtype=np.float64)[owners]))
    return pairs[order].reshape(-1, 2)
