"""Turns a scheduled batch into one forward pass over the paged KV pool."""
from __future__ import annotations

import numpy as np

from ember_cupy.config import EngineConfig, ModelConfig
from ember_cupy.engine.scheduler import ScheduledBatch
from ember_cupy.engine.sequence import Sequence
from ember_cupy.model.checkpoint import Checkpoint
from ember_cupy.model.llama import BatchMetadata, LlamaModel


def kv_block_bytes(model: ModelConfig, block_size: int, itemsize: int) -> int:
    """Bytes of K and V of one block over all layers."""
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * itemsize


class ModelRunner:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig, xp=np, dtype=np.float32):
        self.model_config = checkpoint.config
        self.config = config
        self.xp = xp
        self.model = LlamaModel(checkpoint, xp=xp, dtype=dtype)
        itemsize = np.dtype(dtype).itemsize
        self.num_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_memory // kv_block_bytes(self.model_config, config.block_size, itemsize))
        shape = (self.num_blocks, config.block_size, self.model_config.num_kv_heads, self.model_config.head_dim)
        self.kv_caches = [(xp.zeros(shape, dtype), xp.zeros(shape, dtype))
                          for _ in range(self.model_config.num_layers)]

    def execute(self, batch: ScheduledBatch) -> tuple[object, list[Sequence]]:
        """Run the batch; returns logits [N, vocab] for the N sequences that sample now."""
        self._copy_blocks(batch.block_copies)
        input_ids, metadata, sampling = self._prepare(batch.scheduled)
        logits = self.model.forward(input_ids, metadata, self.kv_caches)
        return logits, sampling

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src, dst = (self.xp.asarray(ids) for ids in zip(*copies))
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _prepare(self, scheduled: list[tuple[Sequence, int]]):
        block_size = self.config.block_size
        num_seqs = len(scheduled)
        query_lens = np.array([n for _, n in scheduled], dtype=np.int32)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        starts = np.array([seq.num_computed_tokens for seq, _ in scheduled], dtype=np.int32)
        context_lens = starts + query_lens
        max_blocks = max(len(seq.block_table) for seq, _ in scheduled)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        input_ids = np.empty(int(query_start_loc[-1]), dtype=np.int64)
        for row, (seq, num_tokens) in enumerate(scheduled):
            block_tables[row, :len(seq.block_table)] = seq.block_table
            start = seq.num_computed_tokens
            input_ids[query_start_loc[row]:query_start_loc[row + 1]] = seq.token_ids[start:start + num_tokens]
        # Position of every row, and its slot in the pool through its sequence's block table.
        row_seq = np.repeat(np.arange(num_seqs), query_lens)
        positions = (np.arange(len(input_ids), dtype=np.int32)
                     - np.repeat(query_start_loc[:-1], query_lens) + np.repeat(starts, query_lens))
        slot_mapping = (block_tables[row_seq, positions // block_size] * block_size
                        + positions % block_size).astype(np.int32)
        sampling = [i for i, (seq, n) in enumerate(scheduled) if seq.num_computed_tokens + n == seq.num_tokens]
        logits_indices = query_start_loc[1:][sampling] - 1
        xp = self.xp
        metadata = BatchMetadata(
            positions=xp.asarray(positions), slot_mapping=xp.asarray(slot_mapping),
            block_tables=xp.asarray(block_tables), context_lens=xp.asarray(context_lens),
            query_start_loc=xp.asarray(query_start_loc), logits_indices=xp.asarray(logits_indices))
        return xp.asarray(input_ids), metadata, [scheduled[i][0] for i in sampling]
