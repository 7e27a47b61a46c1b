"""Logits -> next tokens for a batch of sequences, vectorised over the batch.

Order of processing (as vLLM): penalties and logit_bias and min_tokens on the raw logits;
logprobs are taken from those processed logits; then temperature, top-k, top-p, min-p, and one
draw per sequence from its own generator, so a seeded request gets the same tokens whatever
else shares its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember_cupy.engine.sequence import Sequence


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]   # (token id, logprob), best first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def top_logprobs(logprobs_row: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    top = np.argpartition(-logprobs_row, k - 1)[:k]
    top = top[np.argsort(-logprobs_row[top], kind="stable")]
    return [(int(i), float(logprobs_row[i])) for i in top]


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits, seqs: list[Sequence]) -> SamplerOutput:
        if not isinstance(logits, np.ndarray):  # on the device: copy back only what is needed
            if all(self._plain_greedy(seq) for seq in seqs):
                return SamplerOutput([int(t) for t in logits.argmax(axis=-1).get()], [None] * len(seqs))
            logits = logits.astype(np.float32).get()
        logits = np.array(logits, dtype=np.float32)   # a private host copy we may modify
        for row, seq in enumerate(seqs):
            self._adjust_logits(logits[row], seq)
        logprob_rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        logprobs = log_softmax(logits[logprob_rows]) if logprob_rows else None
        token_ids = np.argmax(logits, axis=-1)
        random_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if random_rows:
            token_ids[random_rows] = self._sample(logits[random_rows], [seqs[i] for i in random_rows])
        token_ids = [int(t) for t in token_ids]
        entries: list[TokenLogprobs | None] = [None] * len(seqs)
        for row, values in zip(logprob_rows, logprobs if logprobs is not None else []):
            token = token_ids[row]
            entries[row] = TokenLogprobs(token, float(values[token]), top_logprobs(values, seqs[row].params.logprobs))
        return SamplerOutput(token_ids=token_ids, logprobs=entries)

    @staticmethod
    def _plain_greedy(seq: Sequence) -> bool:
        """Greedy with nothing that needs the whole row on the host."""
        p = seq.params
        return (p.greedy and p.logprobs is None and not p.logit_bias and p.repetition_penalty == 1.0
                and not p.presence_penalty and not p.frequency_penalty
                and seq.num_output_tokens >= p.min_tokens)

    # --- logits processing --------------------------------------------------------------
    def _adjust_logits(self, row: np.ndarray, seq: Sequence) -> None:
        params = seq.params
        output = seq.output_token_ids
        if params.repetition_penalty != 1.0:
            seen = np.unique(np.asarray(seq.token_ids, dtype=np.int64))
            values = row[seen]
            row[seen] = np.where(values > 0, values / params.repetition_penalty,
                                 values * params.repetition_penalty)
        if (params.presence_penalty or params.frequency_penalty) and output:
            ids, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
            row[ids] -= params.frequency_penalty * counts + params.presence_penalty
        if params.logit_bias:
            ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
            row[ids] += np.fromiter(params.logit_bias.values(), dtype=np.float32)
        if len(output) < params.min_tokens:
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
            row[banned] = -np.inf

    # --- random sampling ----------------------------------------------------------------
    def _sample(self, logits: np.ndarray, seqs: list[Sequence]) -> np.ndarray:
        temperature = np.array([seq.params.temperature for seq in seqs], dtype=np.float32)
        logits /= temperature[:, None]
        self._filter_top_k_top_p(logits, seqs)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        min_p = np.array([seq.params.min_p for seq in seqs], dtype=np.float32)
        if min_p.any():
            probs[probs < (min_p * probs.max(axis=-1))[:, None]] = 0.0
        cumulative = np.cumsum(probs, axis=-1)
        uniforms = np.array([self._rng(seq).random() for seq in seqs])
        targets = uniforms * cumulative[:, -1]
        chosen = np.array([np.searchsorted(c, t, side="right") for c, t in zip(cumulative, targets)])
        return np.minimum(chosen, logits.shape[-1] - 1)

    @staticmethod
    def _filter_top_k_top_p(logits: np.ndarray, seqs: list[Sequence]) -> None:
        vocab = logits.shape[-1]
        top_k = np.array([seq.params.top_k if seq.params.top_k > 0 else vocab for seq in seqs])
        top_p = np.array([seq.params.top_p for seq in seqs], dtype=np.float64)
        if (top_k >= vocab).all() and (top_p >= 1.0).all():
            return
        order = np.argsort(-logits, axis=-1, kind="stable")
        sorted_logits = np.take_along_axis(logits, order, axis=-1)
        rank = np.arange(vocab)[None, :]
        drop = rank >= top_k[:, None]
        probs = np.exp(sorted_logits - sorted_logits[:, :1])
        probs[drop] = 0.0
        cumulative = np.cumsum(probs, axis=-1) / probs.sum(axis=-1, keepdims=True)
        # keep a token while the mass before it is below top_p (the top token always stays)
        drop |= (cumulative - probs / probs.sum(axis=-1, keepdims=True)) >= top_p[:, None]
        np.put_along_axis(logits, order, np.where(drop, -np.inf, sorted_logits), axis=-1)

    @staticmethod
    def _rng(seq: Sequence) -> np.random.Generator:
        if seq.rng is None:
            seed = seq.params.seed
            seq.rng = np.random.default_rng(None if seed is None else [seed % 2**64, seq.index])
        return seq.rng
