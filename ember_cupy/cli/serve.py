"""`ember-cupy serve`: one model in this process, many models from a directory (router mode), or
replicas on Ray Serve."""
from __future__ import annotations

import asyncio
import logging
import os

from ember_cupy.cli.flags import engine_config
from ember_cupy.cli.llamacpp_flags import apply_llamacpp_flags
from ember_cupy.cli.loading import BackgroundLoad, check_dtype, load_engine
from ember_cupy.cli.vllm_flags import check_generation_config, check_vllm_flags


def served_names(args) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model:
        base = os.path.basename(os.path.normpath(args.model))
        return [base.removesuffix(".gguf")]
    return ["SmolLM2-135M-Instruct"]


def check_serve_args(args) -> None:
    """Everything that would fail only after the server is up fails here, as one line: the
    model's path, the port, the dtype, the engine flags, an address already in use."""
    from ember_cupy.model.loader import resolve_model_path
    from ember_cupy.server.listen_address import check_can_listen
    if args.model_tag is not None:
        args.model = args.model_tag
    apply_llamacpp_flags(args)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_prompt_tokens_per_request < 1:
        raise ValueError(f"--max-prompt-tokens-per-request must be >= 1, got {args.max_prompt_tokens_per_request}")
    if not args.prepare_timeout > 0:
        raise ValueError(f"--prepare-timeout must be > 0 seconds, got {args.prepare_timeout}")
    check_vllm_flags(args)
    if args.models_dir is not None:
        _check_router_args(args)
    else:
        check_generation_config(args, resolve_model_path(args.model))
    engine_config(args)
    check_dtype(args)
    check_can_listen(args.host, args.port)


def _check_router_args(args) -> None:
    from ember_cupy.server.model_pool import discover_models
    if args.model is not None or args.served_model_name:
        raise ValueError("--models-dir serves the directory's models by their file names: "
                         "give no MODEL, --model or --served-model-name with it")
    if not os.path.isdir(args.models_dir):
        raise ValueError(f"--models-dir {args.models_dir!r} is not a directory")
    if not discover_models(args.models_dir):
        raise ValueError(f"--models-dir {args.models_dir!r} holds no .gguf file and no folder with a config.json")
    if args.models_max < 1:
        raise ValueError(f"--models-max must be at least 1, got {args.models_max}")
    if args.data_parallel_backend == "ray":
        raise ValueError("--models-dir and --data-parallel-backend ray cannot be combined")


def server_settings(args, served_model_names: list[str] | None = None):
    """The ServerSettings of `serve`'s flags (the plain server's, the Ray ingress's, or one of the
    router's models', named `served_model_names`)."""
    from ember_cupy.server import ServerSettings
    return ServerSettings(host=args.host, port=args.port,
                          served_model_names=served_model_names or served_names(args),
                          api_key=args.api_key or None, allowed_origins=list(args.allowed_origins or []),
                          max_body_bytes=args.max_request_body_bytes, drain_timeout=args.drain_timeout,
                          read_timeout=args.read_timeout, response_store_bytes=args.response_store_bytes,
                          max_prompt_tokens_per_request=args.max_prompt_tokens_per_request,
                          model_path=args.model, reasoning_parser=args.reasoning_parser,
                          tool_call_parser=args.tool_call_parser, max_logprobs=args.max_logprobs)


def cmd_serve(args) -> int:
    check_serve_args(args)   # before logging is set up and before the socket opens
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ember_cupy.ray_serve import cli as ray_cli
    if args.models_dir is None and not ray_cli.uses_ray(args):
        return _serve_one_model(args)
    from ember_cupy.server import serve
    settings = server_settings(args)
    if args.models_dir is not None:
        return asyncio.run(serve(None, settings, app=_router_app(args, settings)))
    return ray_cli.run(args, engine_config(args), settings)   # --data-parallel-backend ray: replicas on Ray Serve


def _serve_one_model(args) -> int:
    """The model starts loading before the server's modules import (aiohttp and the protocol's
    pydantic models, ~0.35 s of this 2-vCPU VM's start): a first start packs its weights in C,
    without the GIL, meanwhile. The server's thread policy (a 0.5 ms GIL switch interval) is set
    first: at CPython's 5 ms the load thread waited out the imports after each of its C calls."""
    from ember_cupy.server.thread_policy import apply_server_thread_policy
    apply_server_thread_policy()
    loading = BackgroundLoad(lambda: load_engine(args))
    from ember_cupy.server import serve
    settings = server_settings(args)
    return asyncio.run(serve(_async_engine(args, settings.served_model_names[0], factory=loading.result), settings))


def _async_engine(args, name: str, model: str | None = None, progress: bool = True, factory=None):
    from ember_cupy.server import AsyncEngine, EngineMetrics
    return AsyncEngine(factory=factory or (lambda: load_engine(args, model, progress)), metrics=EngineMetrics(name),
                       max_waiting=args.max_waiting, stream_stall_timeout=args.stream_stall_timeout,
                       prepare_timeout=args.prepare_timeout)


def _router_app(args, settings):
    """Every model of --models-dir behind one address, each loaded on its first request."""
    from ember_cupy.host_memory import memory_limit
    from ember_cupy.model.loader import describe_model
    from ember_cupy.server.api import build_app
    from ember_cupy.server.model_pool import ModelPool, discover_models
    from ember_cupy.server.model_router import build_router_app

    def make_app(name: str, path: str):
        engine = _async_engine(args, name, path, progress=False)
        return engine, build_app(engine, server_settings(args, [name]))

    pool = ModelPool(discover_models(args.models_dir), make_app, describe=describe_model, models_max=args.models_max,
                     idle_ttl=args.models_idle_ttl, memory_budget=args.models_memory or memory_limit(),
                     kv_bytes=args.kv_cache_memory)
    return build_router_app(pool, settings)
