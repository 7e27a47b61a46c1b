"""Grammars for StructuredOutputsParams, compiled by llguidance and cached per engine.

One `GrammarCompiler` per engine: it builds llguidance's tokenizer once (from the `tokenizers`
JSON the engine already has; ~0.4 s for a 49k vocabulary, so only when the first constrained
request arrives) and keeps the compiled matchers in an LRU cache keyed by (kind, spec). A request
gets a private copy of the cached matcher (`LLMatcher.deep_copy`, which shares the compiled
grammar). `compile` is thread-safe: the server calls it from a worker thread, off its event loop.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance

from ember_cupy.structured.constraint import GrammarConstraint
from ember_cupy.structured.params import StructuredOutputsParams

CACHE_SIZE = 256
# JSON is written with ", " and ": " and no other white space (a schema's "x-guidance" may say
# otherwise): free white space lets a small model pad its output with newlines until max_tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's kind names for ours (json_object is compiled as its any-object schema)
_FORMATS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE):
        """tokenizer: ember_cupy.tokenizer.Tokenizer; vocab_size: the width of the model's logits."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    _tokenizer_json(self._tokenizer), n_vocab=self.vocab_size,
                    eos_token=list(self._tokenizer.eos_token_ids))
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The cached matcher of params (compiled on a miss); ValueError naming what is wrong."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        matcher = self._build(params)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def new_constraint(self, params: StructuredOutputsParams) -> GrammarConstraint:
        """A fresh per-sequence state for params."""
        return GrammarConstraint(self.compile(params).deep_copy(), self.vocab_size)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _build(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        kind, spec = params.key
        try:
            if _FORMATS[kind] == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_LAYOUT)
            else:
                grammar = llguidance.grammar_from(_FORMATS[kind], spec)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.{kind}: {exc}") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind} is invalid: {_first_lines(matcher.get_error())}")
        return matcher


def _tokenizer_json(tokenizer) -> str:
    """The `tokenizers.Tokenizer` JSON behind ember's Tokenizer (GGUF vocabularies are rebuilt
    as one at load, so every model has it)."""
    return tokenizer._hf.to_str()


def _first_lines(message: str, limit: int = 6) -> str:
    """llguidance's errors may append the whole grammar; the first lines say what is wrong."""
    lines = message.strip().splitlines()
    return "\n".join(lines[:limit]) + ("\n..." if len(lines) > limit else "")
