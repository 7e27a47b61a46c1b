"""The contract between the server and an engine (vLLM v1's EngineClient): what the HTTP layer may
ask of an engine, in-process (server/async_engine.py's AsyncEngine) or behind Ray Serve
(ray_serve/remote_engine.py's RemoteEngine). The server reads an engine's shape and limits from
`model_info()`, never from its insides."""
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


def model_info_of(llm_engine) -> ModelInfo:
    """The ModelInfo of an LLMEngine (in the engine's process: a Ray replica computes its own)."""
    from ember_cupy.info import runtime_info
    config, runner = llm_engine.config, llm_engine.runner
    return ModelInfo(max_model_len=llm_engine.max_model_len, vocab_size=llm_engine.model_config.vocab_size,
                     hidden_size=llm_engine.model_config.hidden_size, policy=config.policy,
                     max_num_seqs=config.max_num_seqs, block_size=config.block_size,
                     quantization=runner.quantization, weight_bytes=runner.model.weight_bytes(),
                     kv_cache_blocks=runner.num_blocks, runtime=runtime_info(llm_engine),
                     sampling_defaults=dict(llm_engine.sampling_defaults))


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
