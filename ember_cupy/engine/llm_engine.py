"""The synchronous engine: add_request / abort / step(), one continuous-batching step at a time."""
from __future__ import annotations

import copy
import dataclasses
import logging
import time

import numpy as np

from ember_cupy.backend import get_xp, keep_freed_memory_mapped, release_freed_heap, to_numpy
from ember_cupy.chat_template import read_chat_template
from ember_cupy.config import CPU_MAX_NUM_PREFILL_TOKENS, CPU_MAX_NUM_PREFILL_TOKENS_BF16, EngineConfig
from ember_cupy.engine.block_manager import BlockManager
from ember_cupy.engine.draft_proposer import DraftModelProposer
from ember_cupy.engine.model_runner import ModelRunner, PoolShare
from ember_cupy.engine.input_processor import InputProcessor, ProcessedRequest
from ember_cupy.engine.output_processor import OutputProcessor
from ember_cupy.engine.outputs import EngineStepOutput, OutputKind, RequestOutput
from ember_cupy.engine.pooling import PREFILL_ONLY, EmbeddingRequest, PoolingParams
from ember_cupy.engine.prompt_logprobs import prompt_logprob_entries
from ember_cupy.engine.sampler import Sampler
from ember_cupy.engine.scheduler import ScheduledBatch, Scheduler
from ember_cupy.engine.speculator import SpecDecodeStats, Speculator
from ember_cupy.engine.step_costs import StepCosts
from ember_cupy.engine.sequence import Sequence, SequenceStats
from ember_cupy.engine_client import SchedulerStats
from ember_cupy.generation_config import sampling_defaults
from ember_cupy.model.checkpoint import Checkpoint
from ember_cupy.model.loader import load_checkpoint
from ember_cupy.ops.linear import bf16_tiles_ready
from ember_cupy.sampling_params import SamplingParams
from ember_cupy.speculative_config import SpeculativeConfig
from ember_cupy.structured.bitmask import token_bitmasks
from ember_cupy.structured.compiler import GrammarCompiler

logger = logging.getLogger("ember_cupy.engine")


# A KV pool sized from kv_cache_memory must hold at least this many tokens of one sequence (or
# max_model_len, when that is shorter): `--kv-cache-memory 1` used to give a 16-token context.
# An explicit num_kv_blocks is taken as asked (tests and trace replays use tiny pools on purpose).
MIN_KV_CONTEXT = 256


def resolve_prefill_budget(config: EngineConfig, xp) -> EngineConfig:
    """max_num_prefill_tokens=None: a short step on the CPU; on a GPU a step of
    max_num_batched_tokens is fast, and small ones would waste it."""
    if config.max_num_prefill_tokens is not None or xp is not np:
        return config
    bf16 = config.prompt_activations == "auto" and bf16_tiles_ready()
    return dataclasses.replace(config, max_num_prefill_tokens=CPU_MAX_NUM_PREFILL_TOKENS_BF16 if bf16
                               else CPU_MAX_NUM_PREFILL_TOKENS)


class LLMEngine:
    """add_request() turns a request into token ids and parameters (InputProcessor) and queues it;
    step() schedules, runs the model, samples and updates the sequences, then hands what it
    computed to the OutputProcessor for text, stop strings and RequestOutputs.

    process_in_step: True (the default), step() returns RequestOutputs, processed in the caller's
    thread. False (the server's AsyncEngine): step() returns the EngineStepOutput, and the caller
    must pass it to process_outputs() before the next step; so a step on a worker thread does no
    text work."""

    process_in_step = True

    def __init__(self, model: str | Checkpoint | None = None, config: EngineConfig | None = None,
                 progress=None):
        """model: a .gguf path, an HF directory, an already loaded Checkpoint, or None (default)."""
        xp = get_xp()
        self.config = resolve_prefill_budget(config or EngineConfig(), xp)
        self.checkpoint = model if isinstance(model, Checkpoint) else load_checkpoint(model, progress)
        self.model_config = self.checkpoint.config
        tokenizer = self.checkpoint.tokenizer
        if self.config.chat_template is not None:   # on a copy: a shared Checkpoint keeps its own
            tokenizer = copy.copy(tokenizer)
            tokenizer.set_chat_template(read_chat_template(self.config.chat_template))
        self.sampling_defaults = sampling_defaults(self.checkpoint.source, self.config.generation_config,
                                                   self.config.override_generation_config)
        SamplingParams(**self.sampling_defaults)   # a bad default fails the load, not every request
        draft = self._draft_model(self.config.speculative_config, xp, progress)
        # a checkpoint loaded here is consumed by the model, so the weights are held once
        self.runner = ModelRunner(self.checkpoint, self.config, xp=xp,
                                  consume_checkpoint=not isinstance(model, Checkpoint),
                                  pool_share=draft.pool_share() if draft is not None else PoolShare())
        if xp is np:  # step temporaries stay mapped; the KV pool has its own mapping (lazily_zeroed)
            keep_freed_memory_mapped()
            release_freed_heap()   # what the load dropped (its tokenizer's build)
        self._check_kv_pool()
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager, self.model_config.eos_token_ids)
        self.sampler = Sampler(self.model_config.eos_token_ids)
        self.speculator = self._speculator(self.config.speculative_config, draft)
        self.grammars = GrammarCompiler(tokenizer, self.model_config.vocab_size)
        limits = [self.model_config.max_position_embeddings, self.runner.num_blocks * self.config.block_size]
        if self.config.max_model_len:
            limits.append(self.config.max_model_len)
        self.max_model_len = min(limits)
        self.input_processor = InputProcessor(tokenizer, self.grammars, self.model_config.vocab_size,
                                              self.max_model_len, self.config.max_num_seqs, self.config.seed)
        self.output_processor = OutputProcessor(tokenizer, self.model_config.eos_token_ids)
        self.requests: dict[str, list[Sequence]] = {}   # the sequences of each unfinished request
        self.last_step_num_tokens = 0   # tokens the last step computed (vllm:iteration_tokens_total)
        self.stats = SchedulerStats()   # republished after each change (engine_client.py)
        self._publish_stats()
        from ember_cupy.info import describe
        logger.info("%s", describe(self))

    @property
    def tokenizer(self):
        return self.input_processor.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        """The tokenizer requests are tokenized and detokenized with, from the next request on."""
        self.input_processor.tokenizer = self.output_processor.tokenizer = tokenizer

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's token ids, as add_request tokenizes it; touches no engine state, so any
        thread may call it while a step runs."""
        return self.input_processor.tokenize(text, add_special_tokens)

    def compile_constraint(self, params: SamplingParams | PoolingParams, abandoned=None) -> None:
        """Compile a request's grammar into the cache before add_request (which then finds it
        there); any thread, while a step runs (abandoned: GrammarCompiler.compile's)."""
        self.input_processor.compile(params, abandoned)

    def _draft_model(self, config: SpeculativeConfig | None, xp, progress) -> DraftModelProposer | None:
        """The draft model's weights, on the backend before the target's pool is sized."""
        if config is None or config.method != "draft_model":
            return None
        return DraftModelProposer.load(config.model, self.checkpoint, self.config, xp, progress)

    def _speculator(self, config: SpeculativeConfig | None, proposer: DraftModelProposer | None) -> Speculator | None:
        if config is None:
            return None
        if proposer is not None:
            proposer.allocate_pool(self.runner.num_blocks)
        costs = StepCosts(None if proposer is None else proposer.costs.level)
        k = config.num_speculative_tokens
        costs.calibrate(self.runner.time_forward,
                        min(self.config.max_num_batched_tokens, self.config.max_num_seqs * (1 + k)))
        speculator = Speculator(config, costs, proposer)
        self.scheduler.on_free = speculator.proposer.release
        return speculator

    @property
    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's cumulative counts (None when it is off)."""
        return None if self.speculator is None else self.speculator.stats

    def _check_kv_pool(self) -> None:
        if self.config.num_kv_blocks is not None:
            return
        cfg, num_blocks = self.config, self.runner.num_blocks
        wanted = min(MIN_KV_CONTEXT, self.model_config.max_position_embeddings,
                     cfg.max_model_len or MIN_KV_CONTEXT)
        if num_blocks * cfg.block_size >= wanted:
            return
        block_bytes = sum(k.nbytes + v.nbytes for k, v in self.runner.kv_caches) // num_blocks
        need = -(-wanted // cfg.block_size) * block_bytes
        holds = f"holds {num_blocks * cfg.block_size} tokens, and at least {wanted} tokens of context are needed"
        if self.runner.xp is np:
            raise ValueError(f"the KV cache is too small: kv_cache_memory={cfg.kv_cache_memory} bytes {holds}; "
                             f"give kv_cache_memory (--kv-cache-memory) >= {need} bytes "
                             f"({-(-need // (1 << 20))} MiB: {block_bytes} bytes per block of {cfg.block_size} "
                             f"tokens)")
        raise ValueError(f"the KV cache is too small: the device memory left after the weights {holds} "
                         f"({need} bytes); raise gpu_memory_utilization or lower max_num_batched_tokens")

    # --- admission ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | PoolingParams | None = None,
                    *, priority: int = 0, cache_salt: str | None = None,
                    arrival_time: float | None = None, prompt_token_ids: list[int] | None = None,
                    output_kind: OutputKind = OutputKind.CUMULATIVE, prompt_index: int = 0,
                    add_special_tokens: bool = True) -> None:
        """prompt_token_ids: with a string prompt, its token ids as self.tokenizer.encode gave them
        (the server tokenizes off its event loop); the prompt is then not tokenized again.
        add_special_tokens: how a string prompt is tokenized (False for a rendered chat prompt).
        output_kind: what step() returns for this request (ember_cupy/engine/outputs.py).
        prompt_index: the prompt's place among those of one client request (Sequence.prompt_index).
        PoolingParams make an embedding request (ember_cupy/engine/pooling.py): one output, at
        the end, whatever output_kind, with its `embedding`."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.input_processor.process(prompt, params, prompt_token_ids, add_special_tokens)
        stats = SequenceStats(arrival_time=arrival_time or time.monotonic())
        if isinstance(params, PoolingParams):
            seq = Sequence(request_id, request.prompt_token_ids, PREFILL_ONLY, max_tokens=1, priority=priority,
                           cache_salt=cache_salt, stats=stats, pooled=True, prompt_index=prompt_index)
            self.output_processor.add_embedding(EmbeddingRequest(request_id, request.prompt,
                                                                 request.prompt_token_ids, params, seq))
        else:
            seq = self._sequence(request_id, request, priority, cache_salt, stats, prompt_index)
            self.output_processor.add_request(seq, request.prompt, request.params, output_kind)
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)
        self._publish_stats()

    @staticmethod
    def _sequence(request_id: str, request: ProcessedRequest, priority: int, cache_salt: str | None,
                  stats: SequenceStats, prompt_index: int) -> Sequence:
        params = request.params
        return Sequence(request_id, request.prompt_token_ids, params, request.max_tokens, priority=priority,
                        cache_salt=cache_salt, stats=stats, num_pending_forks=params.n - 1,
                        constraint=request.constraint, prompt_index=prompt_index)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; its KV blocks are freed at once."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return None
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self._publish_stats()
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_slots_used(self) -> int:
        """Sequence slots (of max_num_seqs) taken: running sequences and the forks of n > 1
        that running parents will make when their prompt is computed."""
        return self.scheduler.num_slots_used()

    def _publish_stats(self) -> None:
        bm = self.block_manager
        spec = None if self.speculator is None else self.speculator.stats.counts()
        self.stats = SchedulerStats(len(self.scheduler.running), len(self.scheduler.waiting), self.num_slots_used,
                                    bm.usage, bm.num_free_blocks, bm.num_blocks, bm.prefix_stats.queries,
                                    bm.prefix_stats.hits, spec)

    # --- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput] | EngineStepOutput:
        """One step: its RequestOutputs, or (process_in_step False) what it computed, for
        process_outputs()."""
        computed = self.compute_step()
        return self.process_outputs(computed) if self.process_in_step else computed

    def process_outputs(self, computed: EngineStepOutput) -> list[RequestOutput]:
        """The RequestOutputs of a step's EngineStepOutput: text, stop strings (a sequence they end
        finishes here, before the next step), logprobs. Never while a step runs."""
        outputs = self.output_processor.process(computed, self.stop_at_string)
        self._publish_stats()
        return outputs

    def stop_at_string(self, seq: Sequence, stop_string: str, num_after: int) -> None:
        """A stop string ends seq: it finishes, and its num_after newest tokens (verified drafts
        past the stop string) are taken back, as if never generated."""
        self.scheduler.finish(seq, "stop", stop_string)
        if num_after:
            del seq.token_ids[len(seq.token_ids) - num_after:]
        self._forget_if_finished(seq.request_id)

    def compute_step(self) -> EngineStepOutput:
        """Schedule, run the model, sample, update the sequences: no text."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.scheduled()
        self.last_step_num_tokens = batch.num_tokens
        self._publish_stats()   # while the model computes, the step's sequences show as running
        computed = self._compute(batch) if batch else EngineStepOutput()
        self._publish_stats()
        return computed

    def _compute(self, batch: ScheduledBatch) -> EngineStepOutput:
        computed = EngineStepOutput()
        for child in batch.forked:
            self.requests[child.request_id].append(child)
        started = time.perf_counter()
        step_logits = self.runner.execute(batch)
        for seq, first_position, logits in step_logits.prompt_logits:
            computed.prompt_logprobs.append(self._prompt_logprobs(seq, first_position, logits))
        computed.pooled = [(seq, to_numpy(hidden)) for seq, hidden in step_logits.pooled_hidden]
        sampling_seqs, logits = self._sampling_rows(batch, step_logits)
        streams = [Speculator.hold_stream(seq) if seq.draft_token_ids else None for seq, _ in batch.samples]
        sampled = self.sampler(logits, sampling_seqs, token_bitmasks(sampling_seqs, logits.shape[-1]))
        emitted = self._emitted(batch, sampled, streams)
        if self.speculator is not None:
            self.speculator.costs.record(batch.num_tokens, time.perf_counter() - started)
        appended = self.scheduler.update(batch, [tokens for tokens, _ in emitted])
        computed.sampled = [(seq, tokens, logprobs) for (seq, tokens), (_, logprobs) in zip(appended, emitted)]
        for seq in [seq for seq, _ in computed.pooled] + [seq for seq, _ in appended]:
            self._forget_if_finished(seq.request_id)
        return computed

    def _forget_if_finished(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs is not None and all(seq.is_finished for seq in seqs):
            del self.requests[request_id]

    def _sampling_rows(self, batch: ScheduledBatch, step_logits):
        """The rows that sample now, each with the sequence (or its verification view) it samples
        for, and their logits: a fresh fork samples from its parent's row (at most max_num_seqs
        rows), a verifying sequence from each of its 1 + len(drafts) rows."""
        first_row, row = {}, 0
        for seq in step_logits.sampling_seqs:
            first_row[id(seq)] = row
            row += 1 + len(seq.draft_token_ids)
        seqs, rows = [], []
        for seq, source in batch.samples:
            start = first_row[id(source)]
            for j in range(1 + len(seq.draft_token_ids)):
                seqs.append(seq if j == 0 else seq.verification_view(j))
                rows.append(start + j)
        logits = step_logits.sampling_logits
        if rows != list(range(row)):
            logits = logits[self.runner.xp.asarray(rows)]
        return seqs, logits

    def _emitted(self, batch: ScheduledBatch, sampled, streams) -> list[tuple[list[int], list]]:
        """(tokens, their logprobs) of each sequence of batch.samples, from the sampled rows: one
        token, or what the verification of its drafts emits."""
        emitted, row = [], 0
        for (seq, _), stream in zip(batch.samples, streams):
            count = 1 + len(seq.draft_token_ids)
            tokens = [int(t) for t in sampled.token_ids[row:row + count]]
            logprobs = sampled.logprobs[row:row + count]
            if seq.draft_token_ids:
                tokens = self.speculator.verify(seq, tokens)
                Speculator.settle_stream(seq, stream, len(tokens))
            emitted.append((tokens, logprobs[:len(tokens)]))
            row += count
        return emitted

    @staticmethod
    def _prompt_logprobs(seq: Sequence, first_position: int, logits):
        """(seq, first, entries): logits at position p score prompt token p + 1, from first on."""
        first = first_position + 1
        targets = seq.prompt_token_ids[first:first + logits.shape[0]]
        return seq, first, prompt_logprob_entries(to_numpy(logits), targets, seq.params.prompt_logprobs)
