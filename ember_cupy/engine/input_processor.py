"""InputProcessor: a request as the engine takes it (vLLM v1's Processor): the prompt's token ids,
checked against the vocabulary and the context; SamplingParams with the engine's seed drawn; the
grammar's constraint (compiled and bounded by GrammarCompiler's limits); max_tokens resolved.

Its slow parts, tokenize() and compile(), may run first on a worker thread (the server's
AsyncEngine does, off its event loop): process() then finds the prompt's ids given and the
grammar in the compiler's cache. ValueError names what a request gets wrong.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ember_cupy.engine.pooling import PoolingParams
from ember_cupy.sampling_params import SamplingParams, truncate_prompt
from ember_cupy.structured.compiler import GrammarCompiler


@dataclass
class ProcessedRequest:
    prompt: str | None                      # the prompt's text, None when given as token ids
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # SamplingParams: seeded when the engine has a seed
    max_tokens: int = 1                     # resolved: never None
    constraint: object | None = None        # the grammar's matcher (structured outputs)


class InputProcessor:
    def __init__(self, tokenizer, grammars: GrammarCompiler, vocab_size: int, max_model_len: int,
                 max_num_seqs: int, seed: int | None = None):
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self._seeds = None if seed is None else np.random.default_rng(seed)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's token ids (add_special_tokens=False for a rendered chat prompt)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def compile(self, params: SamplingParams | PoolingParams, abandoned=None) -> None:
        """Compile the request's grammar into the cache, if it has one (abandoned: a
        threading.Event set when its caller gave up, GrammarCompiler.compile)."""
        constraint = getattr(params, "structured_outputs", None)
        if constraint is not None:
            self.grammars.compile(constraint, abandoned)

    def process(self, prompt: str | list[int], params: SamplingParams | PoolingParams,
                prompt_token_ids: list[int] | None = None, add_special_tokens: bool = True) -> ProcessedRequest:
        """prompt_token_ids: with a string prompt, its ids as tokenize() gave them (not tokenized again)."""
        if prompt_token_ids is not None and isinstance(prompt, str):
            if not prompt_token_ids:
                raise ValueError("prompt is empty: it must contain at least one token")
            prompt_text, prompt_ids = prompt, list(prompt_token_ids)
        else:
            prompt_text, prompt_ids = self._prompt_ids(prompt, add_special_tokens)
        prompt_ids = truncate_prompt(prompt_ids, params, self.max_model_len)
        if isinstance(params, PoolingParams):
            if len(prompt_ids) > self.max_model_len:
                raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context allows at most "
                                 f"{self.max_model_len}")
            return ProcessedRequest(prompt_text, prompt_ids, params)
        params.check_vocab(self.vocab_size)
        if params.seed is None and self._seeds is not None:
            params = dataclasses.replace(params, seed=int(self._seeds.integers(2**63)))
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=self._bad_words_token_ids(params.bad_words))
        constraint = self.grammars.new_constraint(params.structured_outputs) if params.structured_outputs else None
        max_tokens = self._resolve_max_tokens(len(prompt_ids), params)
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}")
        return ProcessedRequest(prompt_text, prompt_ids, params, max_tokens, constraint)

    def _bad_words_token_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids as it reads alone and after a space (vLLM's two forms)."""
        forms = {tuple(self.tokenize(text, add_special_tokens=False))
                 for word in words for text in (word.lstrip(" "), " " + word.lstrip(" "))}
        return tuple(sorted(ids for ids in forms if ids))

    def _prompt_ids(self, prompt, add_special_tokens: bool) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, add_special_tokens)
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids, text = [int(t) for t in prompt], None
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        return text, ids

    def _resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"prompt has {prompt_len} tokens; the context allows at most "
                             f"{self.max_model_len - 1} to leave room for one generated token")
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"the maximum context length {self.max_model_len}")
        return params.max_tokens
