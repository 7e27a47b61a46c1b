"""llguidance's tokenizer built from ember's own (structured/ll_tokenizer.py) against the one
llguidance builds from the `tokenizers` JSON: the same bytes for every token, the same special
tokens, the same encodings and the same masks, on SmolLM2 and (when installed) Gemma 3's 262k
vocabulary; and it holds less memory."""
import json

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import pytest

from ember_cupy.structured.allocated import allocated_bytes
from ember_cupy.structured.ll_tokenizer import build_ll_tokenizer

TEXTS = ["Hello world", '{"name": "Bob", "age": 42}', "  x\n\n\ty ", "héllo ünïcode 漢字 🙂",
         "<|im_start|>user<|im_end|>", "<bos>text<eos>"]


def from_json(tokenizer, vocab_size):
    return llguidance.LLTokenizer(tokenizer._hf.to_str(), n_vocab=vocab_size,
                                  eos_token=list(tokenizer.eos_token_ids))


def gemma_tokenizer():
    from gemma3_model import gemma3_gguf_path
    import gguf
    from ember_cupy.tokenizer import Tokenizer
    return Tokenizer.from_gguf(gguf.GGUFReader(gemma3_gguf_path()))


@pytest.fixture(params=["smollm2", "gemma3"], scope="module")
def pair(request, checkpoint):
    tokenizer = checkpoint.tokenizer if request.param == "smollm2" else gemma_tokenizer()
    vocab_size = len(tokenizer) + 3   # logits wider than the vocabulary, as some models have
    return tokenizer, vocab_size, build_ll_tokenizer(tokenizer, vocab_size), from_json(tokenizer, vocab_size)


def test_every_token_has_the_same_bytes_and_specialness(pair):
    _, vocab_size, ours, theirs = pair
    assert ours.vocab_size == theirs.vocab_size == vocab_size
    assert ours.eos_tokens == theirs.eos_tokens
    for token_id in range(vocab_size):
        assert ours.decode_bytes([token_id]) == theirs.decode_bytes([token_id]), token_id
        assert ours.is_special_token(token_id) == theirs.is_special_token(token_id), token_id


def test_text_is_encoded_the_same(pair):
    _, _, ours, theirs = pair
    for text in TEXTS:
        assert ours.tokenize_str(text) == theirs.tokenize_str(text), text
        assert ours.tokenize_bytes(text.encode()) == theirs.tokenize_bytes(text.encode()), text


def test_a_schema_gives_the_same_masks_and_forced_tokens(pair):
    tokenizer, vocab_size, ours, theirs = pair
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    matchers = [llguidance.LLMatcher(t, grammar) for t in (ours, theirs)]
    masks = [llg_numpy.allocate_token_bitmask(1, vocab_size) for _ in matchers]
    answer = tokenizer.encode('{"name": "Bob", "age": 42}', add_special_tokens=False)
    for step in range(len(answer) + 1):
        for matcher, mask in zip(matchers, masks):
            llg_numpy.fill_next_token_bitmask(matcher, mask, 0)
        np.testing.assert_array_equal(masks[0], masks[1])
        assert matchers[0].compute_ff_tokens() == matchers[1].compute_ff_tokens()
        if step < len(answer):
            assert all(m.consume_token(answer[step]) for m in matchers)
    assert all(m.is_accepting() for m in matchers)


def test_it_holds_less_memory_than_the_json_build(checkpoint):
    """The JSON build keeps a second `tokenizers` instance: it grows malloc's heap by ~32 MB for
    SmolLM2's 49k, this one by ~20 MB (Gemma 3: ~204 against ~123 MB)."""
    tokenizer, vocab_size = checkpoint.tokenizer, len(checkpoint.tokenizer)
    before = allocated_bytes()
    ours = build_ll_tokenizer(tokenizer, vocab_size)
    ours_bytes = allocated_bytes() - before
    before = allocated_bytes()
    theirs = from_json(tokenizer, vocab_size)
    theirs_bytes = allocated_bytes() - before
    assert ours_bytes < 0.75 * theirs_bytes, (ours_bytes, theirs_bytes)
    del ours, theirs


def test_added_tokens_on_a_byte_level_vocabulary():
    """A user-defined token's text goes through the byte-level decoder as `tokenizers` decodes it
    ("é!" is the bytes E9 21, which decode() shows as "\ufffd!"), as llguidance's JSON loader
    takes it; special tokens and <...> ones are marked special."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    from ember_cupy.tokenizer import Tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    hf = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_tokens([AddedToken("é!", special=False), AddedToken("naïve", special=False),
                   AddedToken("<eos>", special=True)])
    eos = hf.token_to_id("<eos>")
    tokenizer = Tokenizer(hf, bos_token_id=None, eos_token_ids=(eos,), add_bos_token=False, chat_template=None)
    vocab_size = len(tokenizer)
    ours, theirs = build_ll_tokenizer(tokenizer, vocab_size), from_json(tokenizer, vocab_size)
    for token_id in range(vocab_size):
        assert ours.decode_bytes([token_id]) == theirs.decode_bytes([token_id]), token_id
        assert ours.is_special_token(token_id) == theirs.is_special_token(token_id), token_id
    assert ours.decode_bytes([hf.token_to_id("é!")]) == tokenizer.token_bytes(hf.token_to_id("é!")) == b"\xe9!"
