"""The deployment recipes, checked without Docker or Kubernetes (neither runs here): the KubeRay
manifest's Serve config loaded by Ray's own schema, its args by the application builder; the
CLI's data-parallel flags turned into the same builder's args."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("ray.serve", reason="needs the ray extra: pip install 'ember-cupy[ray]'")
yaml = pytest.importorskip("yaml")

DEPLOY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy")


def _serve_config() -> dict:
    with open(os.path.join(DEPLOY, "rayservice.yaml")) as f:
        manifest = yaml.safe_load(f)
    assert manifest["kind"] == "RayService"
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def test_manifest_serve_config_loads_with_rays_schema():
    from ray.serve.schema import ServeDeploySchema
    config = ServeDeploySchema.model_validate(_serve_config())
    (app,) = config.applications
    assert app.import_path == "ember_cupy.ray_serve.app:build"


def test_manifest_args_build_the_application():
    from ray.serve import Application

    from ember_cupy.ray_serve.app import RayServeArgs, build
    args = _serve_config()["applications"][0]["args"]
    assert isinstance(build(args), Application)
    assert RayServeArgs(**args).num_replicas == 4
    with pytest.raises(ValueError, match="num_replica"):
        RayServeArgs(num_replica=2)   # a typo is refused, not ignored


def test_cli_flags_become_builder_args():
    from ember_cupy import cli
    from ember_cupy.ray_serve import cli as ray_cli
    from ember_cupy.ray_serve.app import RayServeArgs, ingress_kwargs, replica_kwargs
    args = cli.build_parser().parse_args(["serve", "--data-parallel-size", "3", "--data-parallel-backend", "ray",
                                          "--threads-per-replica", "2", "--api-key", "k", "--block-size", "32",
                                          "--prepare-timeout", "2.5", "--max-waiting", "7",
                                          "--stream-stall-timeout", "9", "--max-prompt-tokens-per-request", "500",
                                          "--response-store-bytes", "1MiB"])
    assert ray_cli.uses_ray(args)
    built = RayServeArgs(**ray_cli.serve_args(args, cli.engine_config(args), cli.server_settings(args)))
    assert (built.num_replicas, built.num_threads_per_replica) == (3, 2)
    assert built.engine_config["block_size"] == 32 and built.server_settings["api_key"] == "k"
    # issue 24's limits: on each replica (its engine), or on the ingress (its HTTP app), or both
    replica, ingress = replica_kwargs(built), ingress_kwargs(built)
    assert (replica["prepare_timeout"], replica["max_waiting"], replica["stream_stall_timeout"]) == (2.5, 7, 9)
    assert replica["engine_config"]["max_waiting"] == 7 and ingress["prepare_timeout"] == 2.5
    assert ingress["server_settings"]["max_prompt_tokens_per_request"] == 500
    assert ingress["server_settings"]["response_store_bytes"] == 1 << 20
    with pytest.raises(ValueError, match="data-parallel-backend ray"):
        ray_cli.uses_ray(cli.build_parser().parse_args(["serve", "--data-parallel-size", "2"]))
