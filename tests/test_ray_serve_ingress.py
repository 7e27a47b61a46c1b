"""The ingress's relay, built without a Ray cluster: a stand-in engine handle answers `info`, the
ingress starts its loopback app over it (tests/test_ray_serve.py drives a live cluster)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="needs the ray extra: pip install 'ember-cupy[ray]'")

from tiny_model import write_tiny_checkpoint  # noqa: E402

from ember_cupy.engine_client import ModelInfo  # noqa: E402


class _Method:
    def __init__(self, answer):
        self.answer = answer

    async def remote(self):
        return self.answer


def _engine_handle() -> SimpleNamespace:
    """What RemoteEngine.start reads of an engine replica's `info`."""
    info = {"model_info": ModelInfo(max_model_len=64, vocab_size=49152, hidden_size=576, policy="fcfs",
                                    max_num_seqs=4, block_size=16, quantization="none", weight_bytes=0,
                                    kv_cache_blocks=8, runtime={}, sampling_defaults={})}
    return SimpleNamespace(info=_Method(info))


def _relay_connection_limit(model_dir: str, **options) -> int:
    from ember_cupy.ray_serve.ingress import OpenAIIngress

    async def build_and_read():
        ingress = OpenAIIngress.__new__(OpenAIIngress)
        await ingress.__init__(_engine_handle(), model=model_dir, **options)
        try:
            return ingress.session.connector.limit
        finally:
            await ingress.session.close()
            await ingress.server.stop(drain_timeout=0)
    return asyncio.run(build_and_read())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(path)
    return str(path)


def test_relay_holds_as_many_connections_as_the_ingress_admits(model_dir):
    from ember_cupy.ray_serve.app import RayServeArgs
    from ember_cupy.ray_serve.ingress import MAX_ONGOING_REQUESTS
    assert RayServeArgs().ingress_max_ongoing_requests == MAX_ONGOING_REQUESTS == 1024
    assert _relay_connection_limit(model_dir) == MAX_ONGOING_REQUESTS
    assert _relay_connection_limit(model_dir, max_ongoing_requests=300) == 300
