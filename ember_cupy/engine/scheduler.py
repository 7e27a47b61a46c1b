"""Which tokens of which sequences run in the next step. Pure Python, no array code.

Each step has a budget of max_num_seqs sequences and max_num_batched_tokens tokens, of which
at most max_num_prefill_tokens are prompt tokens (steps 2 to 4):
  1. running decodes (1 token each), preempting the least important running sequence by
     recompute when the KV pool cannot grow;
  2. waiting sequences whose whole prompt fits in a reserved share of the step's tokens
     (1/SHORT_PROMPT_SHARE, and no more than the prompt-token budget), in policy order: a short
     request starts at the next step instead of queueing behind the chunks of long prompts (64
     embedding inputs of 1,000 tokens each would otherwise hold every step for minutes); long
     prompts lose at most that share;
  3. running sequences whose prompt is partly computed (chunked prefill) get what is left;
  4. waiting sequences, in policy order, fill the rest, chunked if they do not fit.

The prompt-token budget bounds how long a step takes whatever the prompts: a request that
arrives while a step runs waits for that step, and on two CPU cores a step of 1,024 prompt
tokens takes seconds. It holds while more than one sequence runs or waits: a lone prompt (a
single user's) prefills in whole steps, at full speed. max_num_prefill_tokens=None leaves only
max_num_batched_tokens (the engine resolves None per backend: EngineConfig.max_num_prefill_tokens).

After the forward pass, update() does the step's bookkeeping (vLLM's update_from_output,
nano-vllm's postprocess): computed tokens advance, full blocks enter the prefix cache, sampled
tokens are appended, and a sequence ends on a stop token, EOS or max_tokens. Stop strings need
the text, so the engine checks them (as vLLM's output processor) and calls finish().

n > 1: a request is one sequence until its prompt is computed; when its last prompt chunk is
scheduled it forks its n - 1 siblings (_fork), which share its blocks and sample their first
token from its logits. Every sequence, forked or about to fork, counts against max_num_seqs.

Embedding requests (Sequence.pooled) are scheduled as any prompt, chunked alike; when their last
prompt chunk runs they are in batch.pooled instead of batch.samples, and update() finishes them.

A client request of many prompts (a completions batch, embedding inputs) cannot hold the queue:
fcfs and priority order by the prompt's index in its request before arrival, so every request's
first prompt starts before any request's second (Sequence.prompt_index).

Policies: fcfs (arrival order), priority (smaller priority first, then arrival), sjf (shortest
job first: the prompt length, then the requested max_tokens, a request without max_tokens after
any with one; a request that has waited sjf_aging_steps steps jumps ahead, in arrival order).
sjf cannot rank by the resolved max_tokens: without max_tokens (the chat default) it is "the rest
of the context", which makes every such request the same length.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from ember_cupy.config import EngineConfig
from ember_cupy.engine.block_manager import BlockManager
from ember_cupy.engine.sequence import Sequence, SequenceStatus


_UNBOUNDED = float("inf")   # sjf: a request without max_tokens ranks after any with one
SHORT_PROMPT_SHARE = 8      # 1/8 of a step's tokens go first to waiting prompts that fit in it whole


@dataclass
class ScheduledBatch:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)   # (seq, new tokens)
    block_copies: list[tuple[int, int]] = field(default_factory=list)     # copy-on-write pages
    preempted: list[Sequence] = field(default_factory=list)
    # (seq, source): seq samples a token this step from the logits of source's last scheduled
    # token: itself, or the parent a fresh fork shares its prompt with
    samples: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    forked: list[Sequence] = field(default_factory=list)                 # siblings forked now
    pooled: list[Sequence] = field(default_factory=list)   # embedding sequences whose prompt ends now

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, eos_token_ids=()):
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.step_count = 0
        self._order = itertools.count()   # admission tie-breaker, FCFS among equals
        self._arrival_no: dict[int, int] = {}
        self._preempted: set[int] = set()
        # called with each sequence whose pages are freed (finished, aborted, preempted): what a
        # draft model caches of it goes too (engine/draft_proposer.py)
        self.on_free = None

    # --- queue management ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.stats.arrival_step = self.step_count
        self._arrival_no[id(seq)] = next(self._order)
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Take seq out of the queues, free its blocks, mark it finished."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        self._arrival_no.pop(id(seq), None)
        self._preempted.discard(id(seq))
        seq.status = SequenceStatus.FINISHED
        seq.num_pending_forks = 0
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.stats.finished_time = time.monotonic()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the policy ---------------------------------------------------------------------
    def _waiting_key(self, seq: Sequence):
        """Smaller is served first. Preempted sequences always come back first."""
        arrival = self._arrival_no[id(seq)]
        preempted = 0 if id(seq) in self._preempted else 1
        policy = self.config.policy
        if policy == "priority":
            return (preempted, seq.priority, seq.prompt_index, arrival)
        if policy == "sjf":
            aged = self.step_count - seq.stats.arrival_step >= self.config.sjf_aging_steps
            if aged:
                return (preempted, 0, 0, 0, arrival)
            requested = seq.params.max_tokens
            return (preempted, 1, seq.num_prompt_tokens, _UNBOUNDED if requested is None else requested, arrival)
        return (preempted, seq.prompt_index, arrival)

    def _running_key(self, seq: Sequence):
        """Running order: the last one is the first preemption victim."""
        arrival = self._arrival_no[id(seq)]
        return (seq.priority, arrival) if self.config.policy == "priority" else (arrival,)

    # --- one step -----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        self.step_count += 1
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=self._running_key)
        budget = self._schedule_decodes(batch, budget)
        prefill_budget = self._prefill_budget(budget)
        prefill_budget = self._admit_short_prompts(batch, prefill_budget)
        prefill_budget = self._schedule_partial_prefills(batch, prefill_budget)
        self._admit_waiting(batch, prefill_budget)
        self.running += batch.forked   # after the decodes: never a victim of their preemptions
        return batch

    def _prefill_budget(self, budget: int) -> int:
        """The step's prompt tokens: at most max_num_prefill_tokens while the steps are shared; a
        sequence alone in the engine keeps no one waiting, so its prompt takes what is left (a
        lone prompt prefills at full speed; one that arrives meanwhile waits for that one step,
        then the steps are short)."""
        cap = self.config.max_num_prefill_tokens
        if cap is None or len(self.running) + len(self.waiting) <= 1:
            return budget
        return min(budget, cap)

    def num_slots_used(self, batch: ScheduledBatch | None = None) -> int:
        """Sequences running, forked by `batch` while it is being scheduled, or still to be
        forked by a running parent: what max_num_seqs bounds (and so a step's logits rows)."""
        forked = len(batch.forked) if batch is not None else 0
        return len(self.running) + forked + sum(seq.num_pending_forks for seq in self.running)

    def _schedule_decodes(self, batch: ScheduledBatch, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.num_uncomputed_tokens != 1:
                index += 1
                continue
            self._fit_drafts(seq, budget)
            while not self.block_manager.can_allocate(seq, 1):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                num_tokens = 1 + len(seq.draft_token_ids)
                self._run(batch, seq, num_tokens)
                budget -= num_tokens
                index += 1
        for seq in self.running[index:]:   # not scheduled this step: their drafts are stale next step
            seq.draft_token_ids = []
        return budget

    def _fit_drafts(self, seq: Sequence, budget: int) -> None:
        """Drafts ride along only in room left over: the step's tokens and free KV pages. They
        never preempt anyone."""
        drafts = seq.draft_token_ids[:max(0, budget - 1)]
        if drafts and not self.block_manager.can_allocate(seq, 1 + len(drafts)):
            drafts = []
        seq.draft_token_ids = drafts

    def _schedule_partial_prefills(self, batch: ScheduledBatch, budget: int) -> int:
        started_now = {id(seq) for seq, _ in batch.scheduled}   # short prompts, run whole
        for seq in self.running:
            if budget <= 0:
                break
            if seq.num_uncomputed_tokens <= 1 or id(seq) in started_now:
                continue  # a decode: served (or preempted) above
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if self.block_manager.can_allocate(seq, num_tokens):
                self._run(batch, seq, num_tokens)
                budget -= num_tokens
        return budget

    def _admit_short_prompts(self, batch: ScheduledBatch, budget: int) -> int:
        """Start the waiting sequences whose whole prompt fits in the reserved share of the step."""
        reserve = min(budget, max(1, self.config.max_num_batched_tokens // SHORT_PROMPT_SHARE))
        short = sorted((seq for seq in self.waiting if seq.num_uncomputed_tokens <= reserve),
                       key=self._waiting_key)
        for seq in short:
            if seq.num_uncomputed_tokens > reserve:
                continue
            num_tokens = self._start(batch, seq, reserve)
            if num_tokens == 0:
                break
            reserve -= num_tokens
            budget -= num_tokens
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0:
            num_tokens = self._start(batch, min(self.waiting, key=self._waiting_key), budget)
            if num_tokens == 0:
                break
            budget -= num_tokens

    def _start(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        """Run waiting `seq` for up to `budget` tokens: how many it got, 0 when it has no free
        sequence slot or KV pages (it stays waiting)."""
        if self.num_slots_used(batch) + 1 + seq.num_pending_forks > self.config.max_num_seqs:
            return 0
        cached = self.block_manager.acquire_cached_prefix(seq)
        num_tokens = min(seq.num_uncomputed_tokens, budget)
        if not self.block_manager.can_allocate(seq, num_tokens):
            self.block_manager.free(seq)  # give the cached blocks back; retry next step
            return 0
        self.waiting.remove(seq)
        self._preempted.discard(id(seq))
        if seq.stats.first_scheduled_time is None:   # not a recompute after preemption
            self.block_manager.record_prefix_query(seq.num_tokens, cached)
            seq.stats.first_scheduled_time = time.monotonic()
            seq.stats.num_cached_tokens = cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._run(batch, seq, num_tokens)
        return num_tokens

    def _run(self, batch: ScheduledBatch, seq: Sequence, num_tokens: int) -> None:
        batch.block_copies += self.block_manager.allocate(seq, num_tokens)
        batch.scheduled.append((seq, num_tokens))
        if seq.num_computed_tokens + num_tokens != seq.tokens_with_drafts:
            return
        if seq.pooled:
            batch.pooled.append(seq)
            return
        batch.samples.append((seq, seq))
        if seq.num_pending_forks:
            self._fork(batch, seq, num_tokens)

    def _fork(self, batch: ScheduledBatch, parent: Sequence, num_tokens: int) -> None:
        """The one place n > 1 forks: the siblings share every block of the parent's table,
        including those this step writes, and are computed as far as it will be after the step."""
        for index in range(parent.params.n - parent.num_pending_forks, parent.params.n):
            child = parent.fork(index)
            self.block_manager.fork(parent, child)
            child.num_computed_tokens += num_tokens
            child.status = SequenceStatus.RUNNING
            self._arrival_no[id(child)] = next(self._order)
            batch.forked.append(child)
            batch.samples.append((child, parent))
        parent.num_pending_forks = 0

    # --- after the step -----------------------------------------------------------------
    def update(self, batch: ScheduledBatch, sampled_token_ids) -> list[tuple[Sequence, list[int]]]:
        """Bookkeeping after the forward pass. sampled_token_ids[i] is the token of
        batch.samples[i], or, for a sequence that had drafts, the tokens its verification
        emits (engine/spec_verify.py: the accepted drafts, then the target's own token).
        Returns each sequence of batch.samples with the tokens appended to it: fewer than given
        when one of them ends it. The embedding sequences of batch.pooled finish (their blocks
        stay in the prefix cache)."""
        for seq, num_tokens in batch.scheduled:
            if not seq.draft_token_ids:   # a verifying sequence advances by what it accepts, below
                seq.num_computed_tokens += num_tokens
                self.block_manager.cache_full_blocks(seq)
        for seq in batch.pooled:
            self.finish(seq, "stop")
        now = time.monotonic()
        appended = []
        for (seq, _), tokens in zip(batch.samples, sampled_token_ids, strict=True):
            tokens = [int(t) for t in tokens] if isinstance(tokens, (list, tuple)) else [int(tokens)]
            if seq.draft_token_ids:
                self._accept_drafts(seq, len(tokens) - 1)
            taken = []
            for token_id in tokens:
                self._append_token(seq, token_id, now)
                taken.append(token_id)
                if seq.is_finished:
                    break
            if len(tokens) > 1 and not seq.is_finished:
                self.block_manager.cache_full_blocks(seq)
            appended.append((seq, taken))
        return appended

    def _accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """The step computed seq's last token and its drafts; only the last token and the first
        num_accepted drafts stay computed. The KV pages past them go back to the pool (the
        positions they held are written again when computed next)."""
        seq.num_computed_tokens += 1 + num_accepted
        seq.draft_token_ids = []
        self.block_manager.trim(seq)

    def _append_token(self, seq: Sequence, token_id: int, now: float) -> None:
        if seq.constraint is not None:
            seq.constraint.accept(token_id)
            if seq.constraint.failed:   # a token its grammar refused
                self.finish(seq, "error")
                return
        seq.token_ids.append(token_id)
        stats = seq.stats
        if stats.first_token_time is None:
            stats.first_token_time = now
        stats.last_token_time = now
        params = seq.params
        if seq.can_stop and token_id in params.stop_token_ids:
            self.finish(seq, "stop", token_id)
        elif seq.can_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            self.finish(seq, "stop")
        elif seq.constraint is not None and seq.constraint.is_finished:   # the grammar is complete
            self.finish(seq, "stop")
        elif seq.num_output_tokens >= seq.max_tokens:
            self.finish(seq, "length")

    def _free(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if self.on_free is not None:
            self.on_free(seq)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Recompute preemption: drop seq's KV, keep its tokens, requeue it first."""
        self.running.remove(seq)
        self._free(seq)
        seq.draft_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.stats.num_preemptions += 1
        self._preempted.add(id(seq))
        self.waiting.append(seq)
        batch.preempted.append(seq)
