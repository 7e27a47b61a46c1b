"""Drafts from a smaller model of the same vocabulary (vLLM's "draft_model" method).

The draft model runs beside the target with its own ModelRunner and its own paged KV pool; the
target's scheduler never sees it. Each target sequence that drafts has a shadow Sequence here
(its tokens, how many of them the draft's cache holds, its block table). propose_batch() first
catches each shadow up with the tokens it lacks (the prompt the first time, then the tokens the
target emitted), then decodes up to k tokens, every drafting sequence in one batched forward pass
per token. The catch-up rows ride in the first of those passes, at most a step's prompt-token
budget of them (EngineConfig.max_num_prefill_tokens, else max_num_batched_tokens): a longer lag is
computed over several steps, and its sequence drafts once it is caught up.

The draft decodes greedily: its drafts are deterministic given the context, so its q is one-hot
and verification by the target's own sample (engine/spec_verify.py) is exact rejection sampling:
greedy and seeded sampled output are the output without speculation, token for token, whatever
the draft model; its quality only sets how many drafts are accepted.

Its KV pool: the target pool's blocks, plus one per sequence slot for the drafts past a
sequence's tokens, at the draft's own bytes per block (its layers and heads), so it holds every
token the target can. A shadow that finds no free pages does not draft that step (it never
preempts). Drafts the target does not verify (not scheduled) and those it rejects leave the
shadow's cache at once (keep(), after scheduling and after verification); a finished, aborted
or preempted sequence gives its pages back (release()). The draft pool caches
prefixes as the target's does, so the n sequences of one request share their prompt's pages.

On a GPU the draft's weights are put on the device first (load(), its pool deferred); the
target's pool then takes the device memory left (gpu_memory_utilization) less what the draft's
pool and step need (pool_share(): the draft's bytes per block beside each of the target's, its
extra blocks and its step's activations and logits), and allocate_pool() gives the draft its
blocks. num_kv_blocks, where given, sizes the target's pool as it does without a draft.
"""
from __future__ import annotations

import dataclasses
import time


from ember_cupy.backend import to_numpy
from ember_cupy.config import EngineConfig
from ember_cupy.engine.block_manager import BlockManager
from ember_cupy.engine.model_runner import ModelRunner, PoolShare, step_workspace_bytes
from ember_cupy.engine.scheduler import ScheduledBatch
from ember_cupy.engine.sequence import Sequence
from ember_cupy.engine.step_costs import StepCosts
from ember_cupy.model.checkpoint import Checkpoint
from ember_cupy.model.loader import load_checkpoint
from ember_cupy.sampling_params import SamplingParams

_SHADOW_PARAMS = SamplingParams(temperature=0)


def check_same_vocabulary(draft: Checkpoint, target: Checkpoint, path: str) -> None:
    """A draft token must mean the same to the target: the same vocabulary size and tokens."""
    sizes = draft.config.vocab_size, target.config.vocab_size
    if sizes[0] != sizes[1]:
        raise ValueError(f"speculative_config.model {path!r}: its vocabulary has {sizes[0]} tokens, the "
                         f"target model's {sizes[1]}; a draft model must share the target's vocabulary")
    draft_tokens, target_tokens = draft.tokenizer.vocabulary(), target.tokenizer.vocabulary()
    if draft_tokens != target_tokens:
        by_id = lambda vocab: {i: t for t, i in vocab.items()}   # noqa: E731
        draft_ids, target_ids = by_id(draft_tokens), by_id(target_tokens)
        first = min(i for i in draft_ids.keys() | target_ids.keys() if draft_ids.get(i) != target_ids.get(i))
        raise ValueError(f"speculative_config.model {path!r}: its tokenizer differs from the target's "
                         f"(token id {first} is {draft_ids.get(first)!r} there, {target_ids.get(first)!r} "
                         f"in the target); a draft model must share the target's vocabulary")


def common_prefix(left: list[int], right: list[int]) -> int:
    n = min(len(left), len(right))
    if left[:n] == right[:n]:
        return n
    return next(i for i in range(n) if left[i] != right[i])


class DraftModelProposer:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig, xp):
        """The draft's weights on the backend; its pool waits for allocate_pool()."""
        # a page per sequence slot for each block of drafts past its tokens
        self.extra_blocks = config.max_num_seqs * -(-config.speculative_config.num_speculative_tokens
                                                    // config.block_size)
        config = dataclasses.replace(config, num_kv_blocks=None, speculative_config=None)
        self.config = config
        self.runner = ModelRunner(checkpoint, config, xp=xp, consume_checkpoint=True, defer_pool=True)
        self.max_positions = checkpoint.config.max_position_embeddings
        self.catch_up_budget = config.max_num_prefill_tokens or config.max_num_batched_tokens
        self.costs = StepCosts()   # the draft model's steps, for the gate (engine/speculation_gate.py)
        self._shadows: dict[int, Sequence] = {}   # id(target sequence) -> its shadow

    @classmethod
    def load(cls, path: str, target: Checkpoint, config: EngineConfig, xp, progress=None) -> DraftModelProposer:
        draft = load_checkpoint(path, progress)
        check_same_vocabulary(draft, target, path)
        return cls(draft, config, xp)

    def pool_share(self) -> PoolShare:
        """What the target's device pool leaves to this model: a block per target block, the
        blocks for drafts past every sequence's tokens, and the draft's step."""
        runner = self.runner
        step = step_workspace_bytes(self.config, runner.model_config, runner.kv_dtype.itemsize)
        return PoolShare(runner.block_bytes, self.extra_blocks * runner.block_bytes + step)

    def allocate_pool(self, target_num_blocks: int) -> None:
        """As many blocks as the target's and extra_blocks: it holds every token the target can."""
        self.runner.allocate_pool(target_num_blocks + self.extra_blocks)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size, enable_prefix_caching=True)
        self.costs.calibrate(self.runner.time_forward, self.config.max_num_seqs)

    # --- the proposer interface (engine/ngram_proposer.py) ---------------------------------
    def propose_batch(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        """Up to max_tokens[i] greedy drafts to follow seqs[i]'s tokens."""
        drafts: list[list[int]] = [[] for _ in seqs]
        scheduled, budget = [], self.catch_up_budget
        for index, (seq, limit) in enumerate(zip(seqs, max_tokens)):
            limit = min(limit, self.max_positions - seq.num_tokens)
            if limit <= 0 or budget <= 0:
                continue
            shadow = self._caught_up_shadow(seq)
            num_tokens = min(shadow.num_uncomputed_tokens, budget)
            budget -= num_tokens
            scheduled.append((index, shadow, num_tokens, limit))
        while scheduled:
            scheduled = self._draft_step(scheduled, drafts)
        return drafts

    def first_rows(self, seq: Sequence) -> int:
        """Rows of seq's shadow in the first draft step: the tokens it lacks, its last one at
        least (1 for a sequence not seen yet: its prompt's catch-up is paid once, not charged)."""
        shadow = self._shadows.get(id(seq))
        if shadow is None:
            return 1
        computed = min(shadow.num_computed_tokens, common_prefix(shadow.token_ids, seq.token_ids), seq.num_tokens - 1)
        return min(seq.num_tokens - computed, self.catch_up_budget)

    def keep(self, seq: Sequence, num_drafts: int) -> None:
        """seq keeps only its first num_drafts drafts: the shadow forgets the others."""
        shadow = self._shadows.get(id(seq))
        if shadow is not None:
            self._roll_back(shadow, min(shadow.num_tokens, seq.num_tokens + num_drafts))

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(id(seq), None)
        if shadow is not None:
            self.block_manager.free(shadow)

    # --- internals ------------------------------------------------------------------------
    def _caught_up_shadow(self, seq: Sequence) -> Sequence:
        """seq's shadow with seq's tokens: what its cache holds of them stays computed."""
        shadow = self._shadows.get(id(seq))
        if shadow is None:
            shadow = Sequence(seq.request_id, seq.prompt_token_ids, _SHADOW_PARAMS, seq.max_tokens,
                              cache_salt=seq.cache_salt, token_ids=list(seq.token_ids))
            self._shadows[id(seq)] = shadow
            self.block_manager.acquire_cached_prefix(shadow)
            return shadow
        self._roll_back(shadow, common_prefix(shadow.token_ids, seq.token_ids))
        shadow.token_ids += seq.token_ids[shadow.num_tokens:]
        # all computed when its last step did not schedule seq: its last token again, for its logits
        self._uncompute(shadow, shadow.num_tokens - 1)
        return shadow

    def _roll_back(self, shadow: Sequence, num_tokens: int) -> None:
        """Keep the shadow's first num_tokens tokens and the pages of those computed."""
        del shadow.token_ids[num_tokens:]
        self._uncompute(shadow, num_tokens)

    def _uncompute(self, shadow: Sequence, num_tokens: int) -> None:
        """At most num_tokens computed tokens, and the pages of those only."""
        if shadow.num_computed_tokens <= num_tokens:
            return
        block_size = self.block_manager.block_size
        if len(shadow.block_hashes) > num_tokens // block_size:
            # a prefix-cached page would be written again: give it back whole (its hash stays true)
            num_tokens = num_tokens // block_size * block_size
            del shadow.block_hashes[num_tokens // block_size:]
        shadow.num_computed_tokens = num_tokens
        self.block_manager.trim(shadow)

    def _draft_step(self, scheduled, drafts: list[list[int]]):
        """One forward pass of the draft model; returns what the next one computes."""
        batch = ScheduledBatch()
        runnable = []
        for entry in scheduled:
            _, shadow, num_tokens, _ = entry
            if self.block_manager.can_allocate(shadow, num_tokens):
                batch.block_copies += self.block_manager.allocate(shadow, num_tokens)
                batch.scheduled.append((shadow, num_tokens))
                runnable.append(entry)
        if not runnable:
            return []
        started = time.perf_counter()
        rows = self.runner.execute(batch).sampling_logits   # none when only a catch-up chunk ran
        tokens = iter(to_numpy(rows.argmax(axis=-1)).tolist() if rows.shape[0] else [])  # CuPy: no argmax of 0 rows
        self.costs.record(batch.num_tokens, time.perf_counter() - started)
        following = []
        for index, shadow, num_tokens, limit in runnable:
            caught_up = shadow.num_computed_tokens + num_tokens == shadow.num_tokens
            shadow.num_computed_tokens += num_tokens
            if not drafts[index]:   # tokens of the target sequence: their full pages may be shared
                self.block_manager.cache_full_blocks(shadow)
            if not caught_up:       # a long lag: the rest at later steps
                continue
            token = next(tokens)
            shadow.token_ids.append(token)
            drafts[index].append(token)
            if len(drafts[index]) < limit:
                following.append((index, shadow, 1, limit))
        return following
