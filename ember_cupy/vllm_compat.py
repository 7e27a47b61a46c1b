"""vLLM's engine arguments that mean nothing for one engine on one machine without PyTorch: taken
with no effect (each with why), so a vLLM script (`LLM(..., enforce_eager=True)`) or command line
(`--enforce-eager`) runs as it is; and the parallel sizes, where only 1 means something here."""
from __future__ import annotations

# argument -> (its value's kind: None for a switch, why it changes nothing here)
NO_EFFECT = {
    "trust_remote_code": (None, "no model code is run: the architectures are built in"),
    "enforce_eager": (None, "no CUDA graphs are captured today"),
    "disable_log_requests": (None, "prompts are never logged (the access log has no bodies)"),
    "enable_log_requests": (None, "prompts are never logged (the access log has no bodies)"),
    "disable_log_stats": (None, "no periodic stats lines are logged; /metrics has them"),
    "disable_frontend_multiprocessing": (None, "the server and the engine share one process"),
    "disable_uvicorn_access_log": (None, "no uvicorn here: aiohttp's access log is ember's own"),
    "enable_prompt_tokens_details": (None, "usage.prompt_tokens_details is always sent"),
    "enable_request_id_headers": (None, "responses always carry X-Request-Id"),
    "enable_chunked_prefill": (None, "prefill is always chunked (--max-num-prefill-tokens)"),
    "swap_space": (float, "preempted sequences are recomputed, never swapped"),
    "cpu_offload_gb": (float, "weights stay where the backend runs"),
    "max_seq_len_to_capture": (int, "no CUDA graphs are captured today"),
    "max_cudagraph_capture_size": (int, "no CUDA graphs are captured today"),
    "download_dir": (str, "models are local files: nothing is downloaded"),
    "hf_token": (str, "models are local files: nothing is downloaded"),
    "revision": (str, "models are local files: no hub revision is fetched"),
    "tokenizer_revision": (str, "models are local files: no hub revision is fetched"),
    "tokenizer_mode": (str, "the model's own tokenizer is always used"),
    "distributed_executor_backend": (str, "one process per engine (--data-parallel-backend ray for replicas)"),
    "uvicorn_log_level": (str, "no uvicorn here: see --log-level"),
}
PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size")


def check_parallel_size(name: str, size: int, flag: str | None = None) -> None:
    """ValueError unless size is 1: a model runs on one device or CPU here."""
    if size != 1:
        raise ValueError(f"{flag or name} {size}: ember-cupy runs a model on one device or CPU; for more "
                         f"throughput run replicas (--data-parallel-size N --data-parallel-backend ray)")
