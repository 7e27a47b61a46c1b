"""One position's logprobs: the token there and the top alternatives, as the sampler (and prompt
logprobs) report them. Also readable as vLLM's entry, a dict of token id -> Logprob holding the
top tokens and the chosen one, so vLLM scripts that index `completion.logprobs[i][token_id]` run."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """vLLM's Logprob. rank: 1 for the likeliest token; None where the token is not among the top
    asked for (its rank in the whole vocabulary is not computed). decoded_token: not filled here."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]   # (token id, logprob), best first

    def _by_id(self) -> dict[int, Logprob]:
        entries = {token: Logprob(value, rank) for rank, (token, value) in enumerate(self.top, start=1)}
        entries.setdefault(self.token_id, Logprob(self.logprob))
        return entries

    # the read-only dict interface of vLLM's dict[int, Logprob]
    def __getitem__(self, token_id: int) -> Logprob:
        return self._by_id()[token_id]

    def __contains__(self, token_id: object) -> bool:
        return token_id == self.token_id or any(token == token_id for token, _ in self.top)

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_id())

    def __len__(self) -> int:
        return len(self._by_id())

    def keys(self):
        return self._by_id().keys()

    def values(self):
        return self._by_id().values()

    def items(self):
        return self._by_id().items()

    def get(self, token_id: int, default=None):
        return self._by_id().get(token_id, default)
