"""The application builder: `serve run ember_cupy.ray_serve.app:build num_replicas=2`, a Serve
config file's `import_path: ember_cupy.ray_serve.app:build` (args: RayServeArgs), or build(...)
from Python."""
from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from ember_cupy.ray_serve.ingress import MAX_ONGOING_REQUESTS, OpenAIIngress
from ember_cupy.ray_serve.prefix_router import PrefixAwareRouter
from ember_cupy.ray_serve.replica import EngineReplica
from ember_cupy.ray_serve.round_robin_router import RoundRobinRouter
from ember_cupy.server.async_engine import DEFAULT_STREAM_STALL_TIMEOUT
from ember_cupy.server.prepare_workers import DEFAULT_PREPARE_TIMEOUT

ROUTERS = {"prefix": PrefixAwareRouter, "round_robin": RoundRobinRouter,
           "power_of_two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"}


class RayServeArgs(BaseModel):
    """What a Serve config's `args:` (or the CLI) sets; unknown keys are refused."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None                       # .gguf or HF directory (None: SmolLM2-135M)
    served_model_name: list[str] = Field(default_factory=lambda: ["SmolLM2-135M-Instruct"])
    num_replicas: int | Literal["auto"] = 1
    autoscaling_config: dict | None = None         # Serve's, when num_replicas is "auto"
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float = 0.0
    num_threads_per_replica: int | None = None     # EMBER_NUM_THREADS of each replica (host kernels)
    max_ongoing_requests: int = 128                # per engine replica (Serve's default, 5, starves batching)
    ingress_max_ongoing_requests: int = Field(MAX_ONGOING_REQUESTS, ge=1)  # requests one ingress replica serves at once
    router: Literal["prefix", "round_robin", "power_of_two"] = "prefix"
    router_kwargs: dict = Field(default_factory=dict)   # PrefixAwareRouter.initialize_state's
    routing_stats_period_s: float = 0.5
    engine_config: dict = Field(default_factory=dict)   # EngineConfig fields
    max_waiting: int | None = None                 # per replica (--max-waiting)
    stream_stall_timeout: float = Field(DEFAULT_STREAM_STALL_TIMEOUT, gt=0)
    prepare_timeout: float = Field(DEFAULT_PREPARE_TIMEOUT, gt=0)   # tokenizing on the ingress, grammars on a replica
    server_settings: dict = Field(default_factory=dict)  # ServerSettings fields (api_key, ...)
    env_vars: dict[str, str] = Field(default_factory=dict)  # more environment for the replicas


def build(args: RayServeArgs | dict | None = None) -> Application:
    args = args if isinstance(args, RayServeArgs) else RayServeArgs(**(args or {}))
    replica = serve.deployment(EngineReplica, name="EngineReplica", **_replica_options(args))
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress",
                               max_ongoing_requests=args.ingress_max_ongoing_requests,
                               ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": _env(args)}})
    return ingress.bind(replica.bind(**replica_kwargs(args)), **ingress_kwargs(args))


def replica_kwargs(args: RayServeArgs) -> dict:
    """EngineReplica's arguments."""
    return {"model": args.model, "engine_config": args.engine_config, "served_model_name": args.served_model_name[0],
            "max_waiting": args.max_waiting, "stream_stall_timeout": args.stream_stall_timeout,
            "prepare_timeout": args.prepare_timeout}


def ingress_kwargs(args: RayServeArgs) -> dict:
    """OpenAIIngress's arguments, but for the engine handle."""
    return {"model": args.model, "server_settings": {"served_model_names": args.served_model_name,
                                                     **args.server_settings},
            "prepare_timeout": args.prepare_timeout}


def _replica_options(args: RayServeArgs) -> dict:
    env = _env(args)
    if args.num_threads_per_replica:
        env.update(EMBER_NUM_THREADS=str(args.num_threads_per_replica),
                   OMP_NUM_THREADS=str(args.num_threads_per_replica))
    options = {"max_ongoing_requests": args.max_ongoing_requests,
               "ray_actor_options": {"num_cpus": args.num_cpus_per_replica, "num_gpus": args.num_gpus_per_replica,
                                     "runtime_env": {"env_vars": env}},
               "request_router_config": RequestRouterConfig(
                   request_router_class=ROUTERS[args.router], request_router_kwargs=args.router_kwargs,
                   request_routing_stats_period_s=args.routing_stats_period_s)}
    if args.num_replicas == "auto":
        options["autoscaling_config"] = args.autoscaling_config or {"min_replicas": 1, "max_replicas": 4}
    else:
        options["num_replicas"] = args.num_replicas
    return options


def _env(args: RayServeArgs) -> dict[str, str]:
    """The driver's EMBER_* settings (backend, threads) go to the replicas, then env_vars."""
    env = {k: v for k, v in os.environ.items() if k.startswith("EMBER_")}
    env.update(args.env_vars)
    return env
