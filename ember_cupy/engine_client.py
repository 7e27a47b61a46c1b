"""The contract between the server and an engine (vLLM v1's EngineClient): what the HTTP layer may
ask of an engine, in-process (server/async_engine.py's AsyncEngine) or behind Ray Serve
(ray_serve/remote_engine.py's RemoteEngine). The server reads an engine's shape and limits from
`model_info()`, and its queues and KV cache from the SchedulerStats an LLMEngine publishes as
`engine.stats` after every change a caller can see (a request added or aborted, a step scheduled,
so a step being computed shows as running, a step done): never from its insides. SchedulerStats
is frozen and replaced whole, so a reader on another thread sees one moment, never half of two."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ModelInfo:
    """An engine's model, limits and runtime, as the server needs them."""
    max_model_len: int
    vocab_size: int
    hidden_size: int
    policy: str                  # the waiting queue's order: fcfs | priority
    max_num_seqs: int
    block_size: int
    quantization: str
    weight_bytes: int
    kv_cache_blocks: int
    runtime: dict                # info.runtime_info of the engine's process (backend, kernels, determinism)
    sampling_defaults: dict      # SamplingParams field -> the model's default (generation_config.py)
    kv_cache_dtype: str = "unknown"
    enable_prefix_caching: bool = False
    source: str = ""             # the model's file or directory
    architecture: str = "unknown"
    file_type: str = "unknown"   # the checkpoint's ModelFacts: Q4_K_M, BF16, ...
    num_parameters: int = 0


@dataclass(frozen=True)
class SpecDecodeCounts:
    """Speculative decoding's cumulative counts (vLLM's spec_decode_* counters)."""
    num_drafts: int                       # verifications (a sequence's drafts in one step)
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]


@dataclass(frozen=True)
class SchedulerStats:
    """An engine's queues and KV cache at one moment (vLLM v1's SchedulerStats)."""
    num_running: int = 0             # sequences in the running batch
    num_waiting: int = 0             # requests queued, new or preempted
    num_slots_used: int = 0          # running sequences + the forks running parents will make (n > 1)
    kv_cache_usage: float = 0.0      # fraction of KV blocks a sequence references
    num_free_blocks: int = 0         # blocks held only by the prefix cache count as free
    num_blocks: int = 0
    prefix_cache_queries: int = 0    # cumulative prompt tokens looked up / found in the prefix cache
    prefix_cache_hits: int = 0
    spec_decode: SpecDecodeCounts | None = None   # None: speculation is off


def model_info_of(llm_engine) -> ModelInfo:
    """The ModelInfo of an LLMEngine (in the engine's process: a Ray replica computes its own)."""
    from ember_cupy.info import runtime_info
    config, runner, facts = llm_engine.config, llm_engine.runner, llm_engine.checkpoint.facts
    return ModelInfo(max_model_len=llm_engine.max_model_len, vocab_size=llm_engine.model_config.vocab_size,
                     hidden_size=llm_engine.model_config.hidden_size, policy=config.policy,
                     max_num_seqs=config.max_num_seqs, block_size=config.block_size,
                     quantization=runner.quantization, weight_bytes=runner.model.weight_bytes(),
                     kv_cache_blocks=runner.num_blocks, runtime=runtime_info(llm_engine),
                     kv_cache_dtype=str(runner.kv_caches[0][0].dtype) if runner.kv_caches else "unknown",
                     enable_prefix_caching=bool(config.enable_prefix_caching),
                     sampling_defaults=dict(llm_engine.sampling_defaults), source=llm_engine.checkpoint.source,
                     architecture=llm_engine.model_config.architecture,
                     file_type=facts.file_type if facts else "unknown", num_parameters=facts.num_parameters if facts else 0)


class EngineClient(Protocol):
    """What server/ uses of an engine."""
    error: str | None
    metrics: object              # EngineMetrics or None

    @property
    def is_ready(self) -> bool: ...
    @property
    def tokenizer(self): ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def num_in_flight(self) -> int: ...

    def model_info(self) -> ModelInfo: ...
    async def start(self) -> None: ...
    async def shutdown(self, drain_timeout: float = 0.0) -> None: ...
    async def off_loop(self, fn, *args, work_chars: int = 0, **kwargs): ...
    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    async def add_request(self, prompt, params=None, *, request_id: str, priority: int = 0,
                          cache_salt: str | None = None, prompt_token_ids: list[int] | None = None,
                          prompt_index: int = 0, add_special_tokens: bool = True): ...
