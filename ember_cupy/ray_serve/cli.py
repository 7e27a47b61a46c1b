"""`ember-cupy serve --data-parallel-size N --data-parallel-backend ray [--ray-address ...]`:
the same flags as the plain server, N engine replicas on a Ray cluster behind one endpoint."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading

log = logging.getLogger("ember_cupy.ray_serve")


def add_data_parallel_flags(parser: argparse.ArgumentParser, add) -> None:
    """The data-parallel flag group of `serve` (vLLM's names); `add` is cli._add (EMBER_* defaults)."""
    g = parser.add_argument_group("data parallel (Ray Serve)")
    add(g, "--data-parallel-size", type=int, default=1, help="engine replicas behind the endpoint")
    add(g, "--data-parallel-backend", choices=("none", "ray"), default="none",
        help="ray: run the replicas on a Ray cluster with Ray Serve (pip install 'ember-cupy[ray]')")
    add(g, "--ray-address", default=None,
        help="join this Ray cluster (e.g. ray://head:10001 or auto); default: start a local one")
    add(g, "--threads-per-replica", type=int, default=None, help="host-kernel threads of each replica")
    add(g, "--cpus-per-replica", type=float, default=1.0, help="Ray CPUs each replica reserves")
    add(g, "--gpus-per-replica", type=float, default=0.0, help="Ray GPUs each replica reserves")
    add(g, "--router", choices=("prefix", "round_robin", "power_of_two"), default="prefix",
        help="replica choice: prefix-cache aware (default), round-robin, or Serve's power of two choices")


def uses_ray(args) -> bool:
    if args.data_parallel_backend == "ray":
        return True
    if args.data_parallel_size != 1:
        raise ValueError("--data-parallel-size > 1 needs --data-parallel-backend ray")
    return False


def serve_args(args, engine_config, settings) -> dict:
    """RayServeArgs (app.py) from the parsed flags, the EngineConfig and the ServerSettings."""
    server = {k: v for k, v in dataclasses.asdict(settings).items()
              if k not in ("host", "port", "model_path", "served_model_names")}
    return {"model": args.model, "served_model_name": settings.served_model_names,
            "num_replicas": args.data_parallel_size, "num_cpus_per_replica": args.cpus_per_replica,
            "num_gpus_per_replica": args.gpus_per_replica, "num_threads_per_replica": args.threads_per_replica,
            "router": args.router, "engine_config": dataclasses.asdict(engine_config),
            "max_waiting": args.max_waiting, "stream_stall_timeout": args.stream_stall_timeout,
            "prepare_timeout": args.prepare_timeout, "server_settings": server}


def run(args, engine_config, settings) -> int:
    """Start (or join) the cluster, deploy, serve until SIGINT/SIGTERM, then tear the app down."""
    import ray
    from ray import serve

    from ember_cupy.ray_serve.app import build
    ray.init(address=args.ray_address or "local", include_dashboard=False)   # "local": a new cluster, never a stray one
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(build(serve_args(args, engine_config, settings)), name="ember-cupy", route_prefix="/")
    log.info("serving on http://%s:%d with %d replica(s) on Ray", settings.host, settings.port,
             args.data_parallel_size)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete("ember-cupy")
    ray.shutdown()
    return 0
