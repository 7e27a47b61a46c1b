"""POST /v1/embeddings on the real model: input forms, float and base64, usage, the openai SDK,
chunked prefill and concurrent generation leave the embedding unchanged, bad input -> 400."""
from __future__ import annotations

import base64
import concurrent.futures
import json
import time

import numpy as np
import pytest
from server_helpers import MODEL, http

from ember_cupy.server.protocol.embeddings import EmbeddingResponse

E = "/v1/embeddings"
TEXTS = ["The cat sat on the mat.", "A cat was sitting on the mat.",
         "Stock markets fell sharply today amid inflation fears."]
LONG = " ".join(["the fishermen rose before dawn and sailed out past the lighthouse"] * 5)
TOL = 1e-5


def embed(base_url, body) -> dict:
    status, _, raw = http(base_url, "POST", E, {"model": MODEL, **body})
    assert status == 200, raw
    reply = json.loads(raw)
    EmbeddingResponse.model_validate(reply)   # the shape /openapi.json documents
    return reply


def vectors(reply) -> np.ndarray:
    return np.array([d["embedding"] for d in sorted(reply["data"], key=lambda d: d["index"])])


def tokens(base_url, text) -> list[int]:
    return json.loads(http(base_url, "POST", "/tokenize", {"prompt": text})[2])["tokens"]


def settled(server, timeout: float = 10.0) -> bool:
    """Whether the engine holds no request and every KV block is free again (an abort takes
    effect between two steps, so shortly after a response)."""
    engine = server.engine.engine
    deadline = time.monotonic() + timeout
    while engine.requests or engine.block_manager.num_free_blocks != engine.block_manager.num_blocks:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def chunked_server(start_server):
    """Prefills at most 16 tokens a step: LONG is embedded over several steps."""
    return start_server(max_num_batched_tokens=16, enable_prefix_caching=False)


def test_list_of_strings(base_url, server):
    reply = embed(base_url, {"input": TEXTS})
    assert reply["object"] == "list" and reply["model"] == MODEL
    assert [d["index"] for d in reply["data"]] == [0, 1, 2] and all(d["object"] == "embedding" for d in reply["data"])
    e = vectors(reply)
    assert e.shape == (3, 576)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-6)
    assert e[0] @ e[1] > e[0] @ e[2] + 0.1    # the paraphrase is closer than the unrelated sentence
    num_tokens = sum(len(tokens(base_url, t)) for t in TEXTS)
    assert reply["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    assert settled(server)


def test_input_forms_agree(base_url):
    one = vectors(embed(base_url, {"input": TEXTS[0]}))
    ids = tokens(base_url, TEXTS[0])
    by_ids = vectors(embed(base_url, {"input": ids}))
    by_id_lists = vectors(embed(base_url, {"input": [ids, tokens(base_url, TEXTS[1])]}))
    np.testing.assert_allclose(by_ids, one, atol=TOL)
    np.testing.assert_allclose(by_id_lists[:1], one, atol=TOL)
    assert by_id_lists.shape == (2, 576)


def test_base64_is_the_float32_bytes(base_url):
    floats = vectors(embed(base_url, {"input": TEXTS[:2]}))
    reply = embed(base_url, {"input": TEXTS[:2], "encoding_format": "base64"})
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in reply["data"]])
    np.testing.assert_array_equal(decoded, floats.astype(np.float32))


def test_openai_sdk(client, base_url):
    """The SDK asks for base64 and decodes it (numpy) unless told otherwise."""
    expected = vectors(embed(base_url, {"input": TEXTS}))
    result = client.embeddings.create(model=MODEL, input=TEXTS)
    np.testing.assert_allclose(np.array([d.embedding for d in result.data]), expected, atol=1e-6)
    assert result.usage.prompt_tokens > 0
    as_float = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(as_float.data[0].embedding, expected[0], atol=1e-6)


def test_chunked_prefill_gives_the_same(base_url, chunked_server):
    assert len(tokens(base_url, LONG)) > 3 * 16
    whole = vectors(embed(base_url, {"input": LONG}))
    np.testing.assert_allclose(vectors(embed(chunked_server.url, {"input": LONG})), whole, atol=TOL)
    assert settled(chunked_server)


def test_alongside_streamed_generation(base_url, server):
    """Embeddings admitted while generation requests stream share their steps: same vectors."""
    alone = vectors(embed(base_url, {"input": TEXTS}))
    generation = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
                  "stream": True, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(http, base_url, "POST", "/v1/completions", generation) for _ in range(3)]
        embeds = [pool.submit(embed, base_url, {"input": TEXTS}) for _ in range(3)]
        for future in embeds:
            np.testing.assert_allclose(vectors(future.result()), alone, atol=TOL)
        assert all(f.result()[0] == 200 for f in streams)
    assert settled(server)


@pytest.mark.parametrize("body, param", [
    ({"input": TEXTS[0], "dimensions": 64}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ""}, "input"),
    ({"input": 5}, "input"),
    ({"input": ["a", 1]}, "input"),
    ({"input": [10**7]}, "input"),
    ({"input": ["fine", "word " * 600]}, "input"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "pooling": "mean"}, "pooling"),
    ({}, "input"),
])
def test_bad_input_is_a_400(base_url, server, body, param):
    status, _, raw = http(base_url, "POST", E, {"model": MODEL, **body})
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == param and error["message"]
    assert settled(server)


def test_clear_messages(base_url):
    status, _, raw = http(base_url, "POST", E, {"model": MODEL, "input": "x", "dimensions": 64})
    assert "576 dimensions" in json.loads(raw)["error"]["message"]
    assert embed(base_url, {"input": "x", "dimensions": 576})["data"][0]["embedding"]   # the native size
    status, _, raw = http(base_url, "POST", E, {"model": MODEL, "input": ["fine", "word " * 600]})
    assert json.loads(raw)["error"]["message"].startswith("input[1]: ")
    status, _, raw = http(base_url, "POST", E, {"model": "nope", "input": "x"})
    assert status == 404 and json.loads(raw)["error"]["param"] == "model"
