"""Grammars for StructuredOutputsParams, compiled by llguidance and cached per engine.

One `GrammarCompiler` per engine: it builds llguidance's tokenizer once (from the engine's own
tokenizer, ll_tokenizer.py; ~0.2 s for a 49k vocabulary, holding the GIL: the server builds it
once idle after start-up, the offline engine when the first constrained request arrives) and keeps
the compiled matchers in an LRU cache keyed by StructuredOutputsParams.key.
A request gets a private copy of the cached matcher (`LLMatcher.deep_copy`, which shares the
compiled grammar). `compile` is thread-safe: the server calls it from a worker thread, off its
event loop.

What a constraint may cost is bounded: it compiles on a thread with a 1 GiB stack (llguidance
recurses once per rule or `$ref` of a chain; large_stack.py), its first token mask is computed
there too (where llguidance builds most of its lexer; a grammar that cannot start, its language
empty, is refused then), and the bytes it allocated meanwhile are its weight: over
max_grammar_bytes it is refused, and the cache keeps at most cache_bytes of them.

What a constraint may cost in time is bounded by llguidance's parser limits (parser_limits.py):
a grammar of more than MAX_GRAMMAR_SYMBOLS symbols is refused before it is built, and every mask
step after the first is bounded by its item and lexer-fuel limits. The first mask is not (its
parser row is never checked against max_items_in_row: a 30,000-rule Lark chain takes seconds),
so it is computed at compile, on the matcher the cache keeps: each request's copy starts with it
and its first step in the engine costs nothing.
"""
from __future__ import annotations

import logging
import threading

import llguidance
import llguidance.numpy as llg_numpy

from ember_cupy.structured.allocated import allocated_bytes
from ember_cupy.structured.closed_objects import close_objects
from ember_cupy.structured.constraint import GrammarConstraint
from ember_cupy.structured.grammar_cache import ByteBoundedCache
from ember_cupy.structured.large_stack import call_with_large_stack
from ember_cupy.structured.ll_tokenizer import build_ll_tokenizer
from ember_cupy.structured.messages import brief
from ember_cupy.structured.params import StructuredOutputsParams
from ember_cupy.structured.parser_limits import PARSER_LIMITS, grammar_size_refusal

logger = logging.getLogger("ember_cupy.structured")

CACHE_SIZE = 256                 # compiled grammars kept, at most ...
CACHE_BYTES = 512 << 20          # ... and their weight in all
MAX_GRAMMAR_BYTES = 128 << 20    # one compiled grammar's weight; more is refused
# llguidance's tokenizer is built when a server starts up to this vocabulary (SmolLM2's 49k: ~0.2 s
# holding the GIL), else at the first constrained request: Gemma 3's 262k take ~1.6 s and ~100 MB,
# which a server that never constrains its output should not pay in load time and memory.
PREPARE_AT_START_MAX_VOCAB = 65536
MiB = 1 << 20
# JSON is written with ", " and ": " and no other white space (a schema's "x-guidance" may say
# otherwise): free white space lets a small model pad its output with newlines until max_tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's kind names for ours (json_object is compiled as its any-object schema)
_FORMATS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}
_EMPTY_LANGUAGE = "NoExtensionBias"   # llguidance's error when no text at all can be generated


class CompileAbandoned(Exception):
    """The request gave up (timed out, disconnected) before its compile could start."""


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE,
                 cache_bytes: int = CACHE_BYTES, max_grammar_bytes: int = MAX_GRAMMAR_BYTES):
        """tokenizer: ember_cupy.tokenizer.Tokenizer; vocab_size: the width of the model's logits."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_grammar_bytes = max_grammar_bytes
        self._cache = ByteBoundedCache(cache_bytes, cache_size)
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()   # one build at a time: each is weighed by the malloc growth
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    @property
    def prepared_at_start(self) -> bool:
        return self.vocab_size <= PREPARE_AT_START_MAX_VOCAB

    @property
    def tokenizer_built(self) -> bool:
        return self._ll_tokenizer is not None

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = build_ll_tokenizer(self._tokenizer, self.vocab_size)
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams,
                abandoned: threading.Event | None = None) -> llguidance.LLMatcher:
        """The cached matcher of params (compiled on a miss); ValueError naming what is wrong.
        abandoned: set when the caller gave up; a build that has not started then never starts
        (CompileAbandoned): builds take turns, so one may wait long for the lock."""
        key = params.key
        matcher = self._cache.get(key)
        if matcher is not None:
            return matcher
        self.ll_tokenizer   # built before a build is weighed
        with self._build_lock:
            matcher = self._cache.get(key)   # built meanwhile by another caller
            if matcher is not None:
                return matcher
            if abandoned is not None and abandoned.is_set():
                raise CompileAbandoned("the request gave up before its grammar compile started")
            before = allocated_bytes()
            try:
                matcher = call_with_large_stack(self._build, params)
            except ValueError as exc:
                logger.info("refused a constraint (%d characters): %s", len(params.spec), exc)
                raise
            weight = max(0, allocated_bytes() - before)
        if weight > self.max_grammar_bytes:
            message = (f"structured_outputs.{params.kind} compiles to {weight / MiB:.0f} MiB; the limit "
                       f"is {self.max_grammar_bytes / MiB:.0f} MiB per constraint")
            logger.info("refused a constraint (%d characters): %s", len(params.spec), message)
            raise ValueError(message)
        self._cache.put(key, matcher, weight)
        return matcher

    def new_constraint(self, params: StructuredOutputsParams) -> GrammarConstraint:
        """A fresh per-sequence state for params."""
        return GrammarConstraint(self.compile(params).deep_copy(), self.vocab_size)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    @property
    def cached_bytes(self) -> int:
        """The weight of the cached grammars (bytes their compiles allocated)."""
        return self._cache.total_bytes

    def _build(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        kind = params.kind
        matcher = llguidance.LLMatcher(self.ll_tokenizer, _grammar(params), log_level=0, limits=PARSER_LIMITS)
        if matcher.is_error():
            error = matcher.get_error()
            raise ValueError(grammar_size_refusal(kind, error)
                             or f"structured_outputs.{kind} is invalid: {brief(error)}")
        self._check_start(matcher, kind)
        return matcher

    def _check_start(self, matcher: llguidance.LLMatcher, kind: str) -> None:
        """The first token mask, on the matcher the cache keeps: it builds the lexer and the first
        parser row the copies share (a copy made before it would compute them again, in the
        engine's step), and tells a grammar that cannot produce any text (an empty language) or
        hits a limit at once."""
        llg_numpy.fill_next_token_bitmask(matcher, llg_numpy.allocate_token_bitmask(1, self.vocab_size), 0)
        if not matcher.is_error():
            return
        error = matcher.get_error()
        if _EMPTY_LANGUAGE in error:
            raise ValueError(f"structured_outputs.{kind} matches no text (its language is empty)")
        raise ValueError(f"structured_outputs.{kind} cannot be used: {brief(error)}")


def _grammar(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for params; ValueError naming what is wrong."""
    kind, spec = params.kind, params.spec
    try:
        if _FORMATS[kind] != "json_schema":
            return llguidance.grammar_from(_FORMATS[kind], spec)
        schema = close_objects(params.json) if params.closes_objects else spec
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except ValueError as exc:
        raise ValueError(f"structured_outputs.{kind}: {brief(str(exc))}") from None
    except RecursionError:   # GBNF is converted to Lark in Python
        raise ValueError(f"structured_outputs.{kind} is nested too deeply") from None
