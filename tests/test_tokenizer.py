"""Tokenizer built from the GGUF, its chat template, and the incremental detokenizer."""
import json
import os

import pytest

from ember_cupy.detokenizer import IncrementalDetokenizer

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "reference_tokens.json")


def _reference_cases():
    if not os.path.exists(FIXTURE):
        return []
    with open(FIXTURE) as f:
        data = json.load(f)
    cases = data["cases"] if isinstance(data, dict) else data
    return [(case["text"], case["ids"]) for case in cases]


@pytest.mark.parametrize("text,expected", _reference_cases())
def test_ids_equal_llama_cpp_tokenizer(tokenizer, text, expected):
    assert tokenizer.encode(text) == expected


def test_fixture_is_present():
    assert len(_reference_cases()) >= 30, "tests/fixtures/reference_tokens.json is missing or short"


def test_digits_are_split_one_by_one(tokenizer):
    ids = tokenizer.encode("12345")
    assert len(ids) == 5 and tokenizer.decode(ids) == "12345"


def test_control_tokens_are_special(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_chat_template_from_the_gguf(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nHi<|im_end|>" in text


@pytest.mark.parametrize("messages", [[], [{"role": "wizard", "content": "x"}], [{"content": "x"}],
                                      "hello", [{"role": "user", "content": 5}]])
def test_bad_messages_are_value_errors(tokenizer, messages):
    with pytest.raises(ValueError):
        tokenizer.apply_chat_template(messages)


def _stream(tokenizer, text, stop=(), include_stop=False):
    """Feed text's tokens one at a time; return the released pieces and the stop matched."""
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tuple(stop), include_stop)
    pieces = []
    for token in ids:
        matched = detok.add_tokens([token])
        pieces.append(detok.release())
        if matched:
            pieces.append(detok.finish())
            return pieces, matched
    pieces.append(detok.finish())
    return pieces, None


@pytest.mark.parametrize("text", ["Xin chào, Tiếng Việt có dấu nhé!", "launch 🚀🔥 now 👍🏽 ok",
                                  "日本語のテキスト", "mixed ✓ ™ é ß"])
def test_incremental_detokenizer_releases_only_whole_characters(tokenizer, text):
    pieces, _ = _stream(tokenizer, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_multibyte_emoji_is_split_across_tokens_yet_comes_out_whole(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1  # the premise: one character, several byte-level tokens
    pieces, _ = _stream(tokenizer, "🚀")
    assert [p for p in pieces if p] == ["🚀"]


def test_stop_string_spanning_tokens_is_never_emitted(tokenizer):
    text = "The answer is forty-two. END OF STORY and more"
    assert len(tokenizer.encode(" END OF STORY")) > 1
    pieces, matched = _stream(tokenizer, text, stop=["END OF STORY"])
    assert matched == "END OF STORY"
    assert "".join(pieces) == "The answer is forty-two. "
    assert not any("END" in p for p in pieces)


def test_stop_string_kept_when_asked(tokenizer):
    pieces, matched = _stream(tokenizer, "one two three four", stop=["three"], include_stop=True)
    assert matched == "three" and "".join(pieces) == "one two three"


def test_earliest_of_several_stops_wins(tokenizer):
    pieces, matched = _stream(tokenizer, "alpha beta gamma delta", stop=["delta", "beta"])
    assert matched == "beta" and "".join(pieces) == "alpha "
