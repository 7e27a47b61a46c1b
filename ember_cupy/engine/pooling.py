"""Embedding requests: a prompt prefilled through the same scheduler as generation, whose final
hidden state is pooled instead of sampled.

Pooling is last-token, vLLM's default for decoder-only LMs (pooling type LAST): the final-normed
hidden state of the prompt's last token, which under causal attention has read the whole
prompt, then L2-normalised. It needs only the row of the last prompt chunk, so a prompt split
over several steps (chunked prefill) pools exactly as one prefilled at once, and a prefix-cache
hit costs nothing: the last token is always computed (BlockManager.acquire_cached_prefix).
Mean pooling would need every prompt row, which a cached prefix never computes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember_cupy.backend import to_numpy
from ember_cupy.engine.outputs import RequestOutput
from ember_cupy.engine.sequence import Sequence, merge_stats
from ember_cupy.sampling_params import SamplingParams, check_truncate_prompt_tokens

POOLING_TYPE = "last"

# The sampling side of an embedding sequence: it never samples, so only what the scheduler
# reads of it matters (one sequence, no prompt logprobs, sjf ranks it by its prompt alone).
PREFILL_ONLY = SamplingParams(max_tokens=1)


@dataclass(frozen=True)
class PoolingParams:
    """What an embedding request asks for (vLLM's PoolingParams)."""
    normalize: bool = True     # L2-normalise the pooled vector
    # keep only the input's last k tokens (-1: as many as the context holds); None: refuse one
    # that is too long (vLLM's truncate_prompt_tokens of LLM.embed and /v1/embeddings)
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        check_truncate_prompt_tokens(self.truncate_prompt_tokens, "PoolingParams")

    @property
    def output_room(self) -> int:
        """Nothing is generated: an input may fill the whole context."""
        return 0


def pool_last_token(hidden_row, normalize: bool) -> list[float]:
    """The embedding from the final hidden state of the prompt's last token [hidden]."""
    vector = to_numpy(hidden_row).astype(np.float64)
    if normalize:
        norm = np.linalg.norm(vector)
        vector = vector / norm if norm > 0 else vector
    return vector.astype(np.float32).tolist()


class EmbeddingRequest:
    """One embedding request of the engine: a single prefill-only sequence and, once its last
    prompt chunk has run, its embedding. Speaks Request's interface (seqs, finished, make_output)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: PoolingParams, seq: Sequence):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seq = seq
        self.embedding: list[float] | None = None

    @property
    def seqs(self) -> list[Sequence]:
        return [self.seq]

    @property
    def finished(self) -> bool:
        return self.seq.is_finished

    def pool(self, hidden_row) -> None:
        self.embedding = pool_last_token(hidden_row, self.params.normalize)

    def make_output(self) -> RequestOutput | None:
        """Nothing until the end (an embedding is not streamed); then the output, outputs empty."""
        if not self.finished:
            return None
        stats = self.seq.stats
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, outputs=[], finished=True,
                             num_cached_tokens=stats.num_cached_tokens, metrics=merge_stats([stats]),
                             embedding=self.embedding)
