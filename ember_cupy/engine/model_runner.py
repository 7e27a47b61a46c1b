"""Turns a scheduled batch into one forward pass over the paged KV pool."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from ember_cupy.backend import lazily_zeroed
from ember_cupy.config import EngineConfig, ModelConfig
from ember_cupy.engine.scheduler import ScheduledBatch
from ember_cupy.engine.sequence import Sequence
from ember_cupy.model.checkpoint import Checkpoint
from ember_cupy.model.decoder import BatchMetadata, DecoderModel
from ember_cupy.model.weight_cache import WeightCache, size_bound
from ember_cupy.ops import _host
from ember_cupy.engine.step_buffers import StepBuffers
from ember_cupy.engine.warmup import warm_up
from ember_cupy.host_memory import check_fits_in_memory
from ember_cupy.ops.cache import resolve_kv_cache_dtype
from ember_cupy.quant import ActivationQuantization


def resolve_dtype(name: str, xp, stored_dtype: str | None = None) -> np.dtype:
    """EngineConfig.dtype -> storage dtype of weights and KV. auto: float32 on NumPy; on CuPy the
    checkpoint's 16-bit dtype (float16 stays float16, bfloat16 stays bfloat16), and bfloat16 for
    GGUF and float32 checkpoints: its range is float32's, while float16 tops out at 65504 and
    SmolLM2-135M's residual stream already peaks at 27,347 (42% of it); larger models carry
    bigger outlier activations. Logits are float32 whatever the dtype (DecoderModel.logits).

    float16 is refused on NumPy: NumPy has no BLAS for float16, so every GEMM runs in its generic
    loops (hundreds of times slower than float32). bfloat16 (ml_dtypes) is allowed: its matmul
    computes in float32 through BLAS."""
    if name == "auto":
        name = "float32" if xp is np else ("float16" if stored_dtype == "float16" else "bfloat16")
    if name == "float16" and xp is np:
        raise ValueError("dtype float16 is not supported on the CPU (NumPy) backend: NumPy has no BLAS "
                         "for float16, so matrix products would run hundreds of times slower than in "
                         "float32; use --dtype float32 (the default there) or bfloat16")
    if name == "bfloat16":
        if xp is not np and int(xp.__version__.split(".")[0]) < 14:
            raise ValueError(f"dtype bfloat16 needs CuPy >= 14 (found {xp.__version__}); "
                             "use --dtype float16 or float32")
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _configure_cupy() -> None:
    """cuBLAS GEMMs accumulate in plain fp32: no TF32 for float32, fp32 accumulation for 16-bit."""
    import cupy
    from cupy._core import _routines_linalg as linalg
    for dtype in (np.float32, np.float16):
        cupy._core.set_compute_type(dtype, linalg.COMPUTE_TYPE_FP32)


def device_kv_bytes(config: EngineConfig, model: ModelConfig, itemsize: int) -> int:
    """CuPy: bytes left for the KV pool once weights are resident, keeping (1 - utilization) of
    the device free plus room for one step's activations and logits."""
    import cupy
    free, total = cupy.cuda.runtime.memGetInfo()
    return int(free - (1.0 - config.gpu_memory_utilization) * total - step_workspace_bytes(config, model, itemsize))


def step_workspace_bytes(config: EngineConfig, model: ModelConfig, itemsize: int) -> int:
    """Device bytes one step may hold besides the pool: its activations and its logits."""
    row = model.hidden_size * 4 + (model.q_size + 2 * model.kv_size) + 2 * model.intermediate_size
    return 2 * config.max_num_batched_tokens * row * itemsize + logits_workspace_bytes(config, model)


def logits_workspace_bytes(config: EngineConfig, model: ModelConfig) -> int:
    """The float32 logits one step may hold: every scheduled token can be a logits row (prompt
    logprobs score each prompt position), so up to max_num_batched_tokens rows, and the sampler's
    working copies of its rows twice: one per sequence, or 1 + num_speculative_tokens per
    sequence with speculative decoding (never more than the step's tokens)."""
    spec = config.speculative_config
    per_seq = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    sampled = min(config.max_num_seqs * per_seq, max(config.max_num_batched_tokens, config.max_num_seqs))
    rows = config.max_num_batched_tokens + 2 * sampled
    return rows * model.vocab_size * 4


def kv_block_bytes(model: ModelConfig, block_size: int, itemsize: int) -> int:
    """Bytes of K and V of one block over all layers."""
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * itemsize


@dataclass(frozen=True)
class PoolShare:
    """What a device KV pool sized from free memory leaves to another pool on the same device (a
    draft model's): block_bytes for each of its own blocks, and fixed_bytes besides."""
    block_bytes: int = 0
    fixed_bytes: int = 0


def _weight_cache(checkpoint: Checkpoint, config: EngineConfig) -> WeightCache | None:
    """The packed-weights cache entry of a checkpoint the host kernels serve (none for the NumPy
    twins' formats, or a checkpoint not read from files)."""
    if _host.active() is None or not os.path.exists(checkpoint.source or ""):
        return None
    return WeightCache.open(checkpoint.source, f"quantization={config.quantization}", config.weight_cache,
                            size_bound(checkpoint.weights))


class ModelRunner:
    """The model's weights on the backend and its paged KV pool. With defer_pool the pool waits for
    allocate_pool() (a draft model's weights are resident before the target sizes its pool)."""

    def __init__(self, checkpoint: Checkpoint, config: EngineConfig, xp=np, dtype=None,
                 consume_checkpoint: bool = False, pool_share: PoolShare = PoolShare(), defer_pool: bool = False):
        self.model_config = checkpoint.config
        self.config = config
        self.xp = xp
        dtype = (resolve_dtype(config.dtype, xp, checkpoint.stored_dtype) if dtype is None
                 else np.dtype(dtype))
        if xp is not np:
            _configure_cupy()
        self.quantization = config.quantization   # model/weights.py: what each backend serves quantized
        self.weight_cache = _weight_cache(checkpoint, config) if xp is np else None
        self.model = DecoderModel(checkpoint, xp=xp, dtype=dtype, quantization=self.quantization,
                                consume=consume_checkpoint,
                                activations=ActivationQuantization(config.activation_passes,
                                                                   config.second_pass_threshold),
                                deterministic=config.deterministic, weight_cache=self.weight_cache,
                                prompt_activations=config.prompt_activations)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, xp, self.quantization)
        self.block_bytes = kv_block_bytes(self.model_config, config.block_size, self.kv_dtype.itemsize)
        self.step_buffers = StepBuffers(xp) if xp is not np else None
        self.num_blocks, self.kv_caches = 0, []
        if not defer_pool:
            self.allocate_pool(config.num_kv_blocks or self._blocks_that_fit(pool_share))

    def _blocks_that_fit(self, share: PoolShare) -> int:
        """NumPy: kv_cache_memory's worth. CuPy: the device memory left, shared with `share`."""
        if self.xp is np:
            return max(1, self.config.kv_cache_memory // self.block_bytes)
        pool_bytes = device_kv_bytes(self.config, self.model_config, self.kv_dtype.itemsize) - share.fixed_bytes
        return max(1, pool_bytes // (self.block_bytes + share.block_bytes))

    def allocate_pool(self, num_blocks: int) -> None:
        """The KV pool of num_blocks blocks (then, on a device, the start-up check: warmup.py)."""
        self.num_blocks = num_blocks
        shape = (num_blocks, self.config.block_size, self.model_config.num_kv_heads, self.model_config.head_dim)
        zeros = lazily_zeroed if self.xp is np else self.xp.zeros
        if self.xp is np:
            check_fits_in_memory(num_blocks * self.block_bytes, f"num_kv_blocks={num_blocks}"
                                 if self.config.num_kv_blocks else "kv_cache_memory (--kv-cache-memory)")
        self.kv_caches = [(zeros(shape, self.kv_dtype), zeros(shape, self.kv_dtype))
                          for _ in range(self.model_config.num_layers)]
        if self.xp is not np:
            warm_up(self)

    def dummy_step(self):
        """A decode row and a 9-token prefill that write nothing into the pool (slots -1): every
        kernel the forward pass uses runs once (decode and prefill attention, the small-batch and
        the large-batch matmuls). Returns the [1, vocab] logits of the decode row."""
        xp = self.xp
        prefill = 9
        blocks = -(-prefill // self.config.block_size)
        metadata = BatchMetadata(
            positions=xp.asarray(np.array([0, *range(prefill)], np.int32)),
            slot_mapping=xp.full(1 + prefill, -1, np.int32),
            block_tables=xp.zeros((2, blocks), np.int32), context_lens=xp.asarray(np.array([1, prefill], np.int32)),
            query_start_loc=xp.asarray(np.array([0, 1, 1 + prefill], np.int32)), logits_indices=xp.zeros(1, np.int64))
        return self.model.forward(xp.zeros(1 + prefill, np.int64), metadata, self.kv_caches)

    def time_forward(self, num_tokens: int, context: int = 128) -> float:
        """Seconds of a forward pass and its logits for num_tokens query rows of one sequence
        after `context` tokens (a verification's shape; a batch of decodes costs alike in its
        matmuls). Reads block 0 for every position and writes nothing into the pool."""
        xp = self.xp
        total = context + num_tokens
        self.model.reserve_positions(total)
        metadata = BatchMetadata(
            positions=xp.asarray(np.arange(context, total, dtype=np.int32)),
            slot_mapping=xp.full(num_tokens, -1, np.int32),
            block_tables=xp.zeros((1, -(-total // self.config.block_size)), np.int32),
            context_lens=xp.asarray(np.array([total], np.int32)),
            query_start_loc=xp.asarray(np.array([0, num_tokens], np.int32)),
            logits_indices=xp.asarray(np.arange(num_tokens, dtype=np.int64)))
        start = time.perf_counter()
        logits = self.model.forward(xp.zeros(num_tokens, np.int64), metadata, self.kv_caches)
        float(logits[0, 0])   # the device finished
        return time.perf_counter() - start

    def execute(self, batch: ScheduledBatch) -> StepLogits:
        """Run the batch; logits of the sequences that sample now, and of prompt positions
        whose logprobs were asked for."""
        self._copy_blocks(batch.block_copies)
        input_ids, metadata, rows = self._prepare(batch.scheduled)
        hidden = self.model.hidden_states(input_ids, metadata, self.kv_caches)
        num_logits_rows = hidden.shape[0] - len(rows.pooled)
        logits = self.model.logits(hidden[:num_logits_rows])
        num_prompt_rows = sum(len(r) for _, _, r in rows.prompt)
        prompt, offset = [], 0
        for seq, first_position, seq_rows in rows.prompt:
            prompt.append((seq, first_position, logits[offset:offset + len(seq_rows)]))
            offset += len(seq_rows)
        pooled = [(seq, hidden[num_logits_rows + i]) for i, seq in enumerate(rows.pooled)]
        return StepLogits(logits[num_prompt_rows:], rows.sampling, prompt, pooled)

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
        self.model.reserve_positions(int(context_lens.max()))
        max_blocks = max(len(seq.block_table) for seq, _ in scheduled)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        input_ids = np.empty(int(query_start_loc[-1]), dtype=np.int64)
        for row, (seq, num_tokens) in enumerate(scheduled):
            block_tables[row, :len(seq.block_table)] = seq.block_table
            input_ids[query_start_loc[row]:query_start_loc[row + 1]] = seq.input_token_ids(num_tokens)
        # Position of every row, and its slot in the pool through its sequence's block table.
        row_seq = np.repeat(np.arange(num_seqs), query_lens)
        positions = (np.arange(len(input_ids), dtype=np.int32)
                     - np.repeat(query_start_loc[:-1], query_lens) + np.repeat(starts, query_lens))
        slot_mapping = (block_tables[row_seq, positions // block_size] * block_size
                        + positions % block_size).astype(np.int32)
        # prompt tokens' rows (a recomputed sequence's generated tokens are not): ops/linear.py linear
        prompt_lens = np.array([seq.num_prompt_tokens for seq, _ in scheduled], dtype=np.int32)
        prompt_rows = positions < np.repeat(prompt_lens, query_lens)
        rows = self._logits_rows(scheduled, query_start_loc)
        prompt_indices = [r for _, _, seq_rows in rows.prompt for r in seq_rows]
        logits_indices = np.array(prompt_indices + rows.sampling_rows + rows.pooled_rows, dtype=np.int64)
        if self.step_buffers is not None:   # the device: one copy into persistent buffers
            ids, *fields = self.step_buffers.upload([input_ids, positions, slot_mapping, block_tables,
                                                     context_lens, query_start_loc, logits_indices])
            names = ("positions", "slot_mapping", "block_tables", "context_lens", "query_start_loc",
                     "logits_indices")
            return ids, BatchMetadata(**dict(zip(names, fields))), rows
        metadata = BatchMetadata(
            positions=positions, slot_mapping=slot_mapping, block_tables=block_tables,
            context_lens=context_lens, query_start_loc=query_start_loc, logits_indices=logits_indices,
            prompt_rows=prompt_rows)
        return input_ids, metadata, rows

    @staticmethod
    def _logits_rows(scheduled, query_start_loc) -> _LogitsRows:
        rows = _LogitsRows()
        for i, (seq, num_tokens) in enumerate(scheduled):
            start, first_row = seq.num_computed_tokens, int(query_start_loc[i])
            if start + num_tokens == seq.tokens_with_drafts:
                last_row = first_row + num_tokens - 1
                if seq.pooled:
                    rows.pooled.append(seq)
                    rows.pooled_rows.append(last_row)
                else:   # a verification scores its last token and every draft: one row each
                    rows.sampling.append(seq)
                    rows.sampling_rows += range(last_row - len(seq.draft_token_ids), last_row + 1)
            last_scored = seq.num_prompt_tokens - 2   # logits at position p score prompt token p + 1
            if seq.params.prompt_logprobs is not None and start <= last_scored:
                count = min(num_tokens, last_scored - start + 1)
                rows.prompt.append((seq, start, list(range(first_row, first_row + count))))
        return rows


@dataclass
class _LogitsRows:
    sampling: list = field(default_factory=list)        # sequences that sample a token now
    sampling_rows: list = field(default_factory=list)   # their last row (and their drafts' rows) in the batch
    prompt: list = field(default_factory=list)          # (seq, first position, rows) for prompt logprobs
    pooled: list = field(default_factory=list)          # embedding sequences whose prompt ends now
    pooled_rows: list = field(default_factory=list)     # their last row in the batch


@dataclass
class StepLogits:
    sampling_logits: object                 # [rows, vocab]: each sampling sequence's 1 + len(drafts) rows
    sampling_seqs: list[Sequence]
    prompt_logits: list[tuple[Sequence, int, object]]   # (seq, first position, [rows, vocab])
    pooled_hidden: list[tuple[Sequence, object]] = field(default_factory=list)   # (seq, [hidden])
