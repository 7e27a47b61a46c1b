"""Embeddings through the Python API on the real model: LLM.embed and LLMEngine with PoolingParams.
An embedding request is a prefill-only request of the same scheduler as generation, its last
token's final hidden state pooled and L2-normalised (ember_cupy/engine/pooling.py)."""
from __future__ import annotations

import numpy as np
import pytest

from ember_cupy import LLM, PoolingParams, SamplingParams

TEXTS = ["The cat sat on the mat.", "A cat was sitting on the mat.",
         "Stock markets fell sharply today amid inflation fears."]
# a prompt of ~70 tokens: several 16-token blocks, several chunks under a budget of 16
LONG = ("In the quiet village by the sea, the fishermen rose before dawn, mended their nets, and "
        "sailed out past the lighthouse while the bakers lit their ovens and the streets slowly woke. "
        "By noon the boats came home heavy with silver fish, gulls circling above the harbour wall, "
        "and the children ran down to the pier to watch the catch being sorted into wooden crates.")
TOL = 1e-5


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, num_kv_blocks=64, block_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def chunked(checkpoint):
    """max_num_batched_tokens=16: a long prompt is prefilled over several steps."""
    return LLM(checkpoint, num_kv_blocks=64, block_size=16, max_model_len=256, max_num_batched_tokens=16,
               enable_prefix_caching=False)


def vectors(outputs) -> np.ndarray:
    return np.array([o.embedding for o in outputs])


def test_shape_norm_and_order(llm):
    outputs = llm.embed(TEXTS)
    assert [o.prompt for o in outputs] == TEXTS
    e = vectors(outputs)
    assert e.shape == (3, llm.engine.model_config.hidden_size)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-6)
    assert all(o.finished and o.outputs.embedding == o.embedding for o in outputs)   # vLLM's shape
    assert llm.engine.block_manager.num_free_blocks == 64 and not llm.engine.requests


def test_similar_sentences_are_closer_than_unrelated(llm):
    cat, cat_again, markets = vectors(llm.embed(TEXTS))
    assert cat @ cat_again > cat @ markets + 0.1


def test_token_ids_equal_text(llm):
    ids = llm.tokenizer.encode(TEXTS[0])
    by_text, by_ids = llm.embed([TEXTS[0], ids])
    assert by_ids.prompt_token_ids == ids
    np.testing.assert_allclose(by_ids.embedding, by_text.embedding, atol=TOL)


def test_chunked_prefill_pools_the_same(llm, chunked):
    """One chunk vs several (16 tokens a step): the same embedding."""
    whole = llm.embed(LONG)[0]
    assert len(whole.prompt_token_ids) > 3 * 16
    engine = chunked.engine
    engine.add_request("long", LONG, PoolingParams())
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
    assert steps >= 4 and outputs[0].request_id == "long"
    np.testing.assert_allclose(outputs[0].embedding, whole.embedding, atol=TOL)


def test_alone_equals_batched_with_generation(llm):
    """Embedding requests computed in the same steps as generation requests (mixed prefill and
    decode batches) give what they give alone; the generations are unchanged too."""
    alone = vectors(llm.embed(TEXTS))
    greedy = SamplingParams(max_tokens=6, temperature=0)
    expected_text = [o.outputs[0].text for o in llm.generate(["Once upon a time", "1, 2, 3,"], greedy)]
    engine = llm.engine
    engine.add_request("gen-0", "Once upon a time", greedy)
    engine.step()   # gen-0 decodes from now on: the embeddings join a decode batch
    engine.add_request("gen-1", "1, 2, 3,", greedy)
    for i, text in enumerate(TEXTS):
        engine.add_request(f"emb-{i}", text, PoolingParams())
    first = engine.step()
    assert {o.request_id for o in first} >= {"gen-0", "gen-1", "emb-0", "emb-1", "emb-2"}
    finals = {o.request_id: o for o in first if o.finished}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    batched = np.array([finals[f"emb-{i}"].embedding for i in range(3)])
    np.testing.assert_allclose(batched, alone, atol=TOL)
    assert [finals[f"gen-{i}"].outputs[0].text for i in range(2)] == expected_text
    assert engine.block_manager.num_free_blocks == 64


def test_prefix_cache_serves_it(llm):
    first, second = llm.embed(LONG)[0], llm.embed(LONG)[0]
    assert first.num_cached_tokens == 0 or first.num_cached_tokens < len(first.prompt_token_ids)
    assert second.num_cached_tokens >= 3 * 16
    np.testing.assert_allclose(second.embedding, first.embedding, atol=TOL)
    assert llm.engine.block_manager.num_free_blocks == 64


def test_abort_mid_prefill_frees_blocks(chunked):
    engine = chunked.engine
    engine.add_request("abort-me", LONG, PoolingParams())
    engine.step()
    assert engine.block_manager.num_free_blocks < 64
    output = engine.abort("abort-me")
    assert output.finished and output.embedding is None
    assert engine.block_manager.num_free_blocks == 64 and not engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt, match", [
    ("", "empty"), ([], "prompts must be"), ([10**7], "outside the vocabulary"),
    ("word " * 300, "context allows at most 256")])
def test_bad_input_is_a_value_error(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.embed(prompt)
    assert not llm.engine.requests and llm.engine.block_manager.num_free_blocks == 64
