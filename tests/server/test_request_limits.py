"""The work one request may ask for, and what it may make others wait for (issue 24 items 4 and 5),
over HTTP on the real model: prompt tokens per request, logprob responses (prompt and generated
tokens; and a stream's, which the engine does not keep), a small request
interleaved with a huge one, and the work before admission (tokenizing, chat templates) counted
against --max-waiting, on threads of its own for small texts, and bounded in time."""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_helpers import MODEL, http, metric, parallel

from ember_cupy.config import CPU_MAX_NUM_PREFILL_TOKENS, CPU_MAX_NUM_PREFILL_TOKENS_BF16
from ember_cupy.engine.llm_engine import LLMEngine
from ember_cupy.ops.linear import bf16_tiles_ready
from ember_cupy.server import logprob_limits

SLOW_MARKER = "SLOW"        # a text that the slowed tokenizer takes SLOW_SECONDS for
SLOW_SECONDS = 1.5
LARGE_CHARS = 100_000       # and a text this long LARGE_SECONDS
LARGE_SECONDS = 3.0


def ids(count: int, start: int = 1000) -> list[int]:
    return [start + i % 500 for i in range(count)]


def chat(url: str, content: str = "Hi", **fields) -> tuple[int, dict, bytes]:
    return http(url, "POST", "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1, **fields})


def error_of(raw: bytes) -> dict:
    return json.loads(raw)["error"]


# --- prompt tokens per request ----------------------------------------------------------------
@pytest.fixture(scope="module")
def capped(start_server):
    return start_server(settings={"max_prompt_tokens_per_request": 1000})


@pytest.mark.parametrize("path,field", [("/v1/embeddings", "input"), ("/v1/completions", "prompt"),
                                        ("/completion", "prompt")])
def test_the_prompt_tokens_of_one_request_are_capped(capped, path, field):
    body = {"model": MODEL, field: [ids(400), ids(400), ids(400)]}
    if path == "/v1/completions":
        body["max_tokens"] = 1
    if path == "/completion":   # llama-server's: an array of id arrays is several prompts
        body["n_predict"] = 1
    status, _, raw = http(capped.url, "POST", path, body)
    assert status == 400, raw[:300]
    error = error_of(raw)
    assert error["param"] == field and "1200 tokens" in error["message"] and "at most 1000" in error["message"]
    assert "--max-prompt-tokens-per-request" in error["message"]
    body[field] = body[field][:2]
    assert http(capped.url, "POST", path, body)[0] == 200


def test_a_chat_prompt_past_the_cap_is_refused(capped):
    status, _, raw = chat(capped.url, "word " * 1200)
    assert status == 400 and error_of(raw)["param"] == "messages", raw[:300]


# --- logprobs: prompt and generated ----------------------------------------------------------
def test_prompt_logprobs_that_would_make_a_huge_response_are_refused(base_url):
    # 4 x 400 prompt tokens, each echoed with 20 logprobs and given 20 prompt_logprobs, twice (n=2):
    # 134,400 entries (~10 MB of JSON; 64 prompts of 390 tokens made 101 MB)
    body = {"model": MODEL, "prompt": [ids(400, 1000 + 7 * i) for i in range(4)], "max_tokens": 1, "n": 2,
            "echo": True, "logprobs": 20, "prompt_logprobs": 20}
    status, _, raw = http(base_url, "POST", "/v1/completions", body)
    assert status == 400, raw[:300]
    error = error_of(raw)
    assert error["param"] == "prompt_logprobs" and "at most 131072" in error["message"], error
    small = {**body, "prompt": [ids(40)]}
    status, _, raw = http(base_url, "POST", "/v1/completions", small)
    assert status == 200 and len(json.loads(raw)["choices"][0]["prompt_logprobs"]) == 40


@pytest.mark.parametrize("path,field,asks", [
    ("/v1/chat/completions", "top_logprobs", {"logprobs": True, "top_logprobs": 21}),
    ("/v1/completions", "logprobs", {"logprobs": 21}),
    ("/v1/completions", "prompt_logprobs", {"prompt_logprobs": 21})])
def test_top_logprobs_are_at_most_20_as_openai(base_url, path, field, asks):
    body = {"model": MODEL, "max_tokens": 1, **asks,
            **({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"})}
    status, _, raw = http(base_url, "POST", path, body)
    assert status == 400 and error_of(raw)["param"] == field, raw[:300]
    assert "20" in error_of(raw)["message"], raw[:300]


@pytest.mark.parametrize("path,field,asks", [
    ("/v1/chat/completions", "top_logprobs", {"logprobs": True, "top_logprobs": 20}),
    ("/v1/completions", "logprobs", {"logprobs": 20})])
def test_generated_logprobs_that_would_make_a_huge_response_are_refused(base_url, path, field, asks):
    """16 choices x 400 tokens x (20 + 1) = 134,400 entries held whole in a non-streamed response
    (n=8, max_tokens=1000 made 12.8 MB of JSON and 271 MiB of server RSS); a stream sends them as
    they come and is not refused."""
    body = {"model": MODEL, "n": 16, "max_tokens": 400, "ignore_eos": True, **asks,
            **({"messages": [{"role": "user", "content": "Count."}]} if "chat" in path else {"prompt": "Count:"})}
    status, _, raw = http(base_url, "POST", path, body)
    assert status == 400, raw[:300]
    error = error_of(raw)
    assert error["param"] == field and "134400 entries" in error["message"], error
    assert "at most 131072" in error["message"] and "max_tokens" in error["message"], error
    assert first_event(base_url, path, {**body, "stream": True}).startswith(b"data: {")


def first_event(url: str, path: str, body: dict) -> bytes:
    """The first server-sent event of a streamed request; then the client leaves (the request is aborted)."""
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        return response.readline()


def test_without_max_tokens_generated_logprobs_stop_where_they_fit(base_url, monkeypatch):
    """No max_tokens (chat's default: until the context is full): each choice generates at most
    the tokens whose logprobs fit and ends with "length" there, instead of a 400 for what it might
    never generate. The limit is lowered here (in this process's server) to 5 tokens of 2 choices
    x 21 entries; at 131072, 16 such choices would stop at 390 tokens."""
    monkeypatch.setattr(logprob_limits, "MAX_LOGPROB_ENTRIES", 5 * 2 * 21 + 41)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "n": 2, "logprobs": True,
            "top_logprobs": 20, "ignore_eos": True}
    status, _, raw = http(base_url, "POST", "/v1/chat/completions", body)
    assert status == 200, raw[:300]
    choices = json.loads(raw)["choices"]
    assert [c["finish_reason"] for c in choices] == ["length", "length"]
    assert [len(c["logprobs"]["content"]) for c in choices] == [5, 5]
    assert all(len(e["top_logprobs"]) == 20 for c in choices for e in c["logprobs"]["content"])
    status, _, raw = http(base_url, "POST", "/v1/chat/completions", {**body, "max_tokens": 3})
    assert status == 200, raw[:300]
    assert [len(c["logprobs"]["content"]) for c in json.loads(raw)["choices"]] == [3, 3]
    status, _, raw = http(base_url, "POST", "/v1/chat/completions", {**body, "max_tokens": 6})
    assert status == 400 and error_of(raw)["param"] == "top_logprobs", raw[:300]


class LogprobHoldingEngine(LLMEngine):
    """The real engine, recording after each step the most generated-token logprobs its requests
    held (what a request keeps between its outputs)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.most_held = 0

    def step(self):
        outputs = super().step()
        held = sum(len(request.state(seq).logprobs) for request in self.output_processor.requests.values()
                   for seq in request.seqs)
        self.most_held = max(self.most_held, held)
        return outputs


def test_a_stream_leaves_no_logprobs_behind_in_the_engine(start_server):
    """Streamed, every token's logprobs go out with its chunk: the engine keeps none of them for the
    rest of the request (it kept them all, n x max_tokens x 21 entries, until the request ended)."""
    server = start_server(engine_factory=LogprobHoldingEngine)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "n": 2, "max_tokens": 40,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "stream": True}
    status, _, raw = http(server.url, "POST", "/v1/chat/completions", body)
    assert status == 200, raw[:300]
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    for index in (0, 1):
        entries = [e for chunk in chunks for c in chunk["choices"] if c["index"] == index and c["logprobs"]
                   for e in c["logprobs"]["content"]]
        assert len(entries) == 40 and all(len(e["top_logprobs"]) == 20 for e in entries)
    assert server.engine.engine.most_held == 0


# --- a small request beside a huge one --------------------------------------------------------
@pytest.mark.parametrize("inputs,tokens", [(12, 500), (60, 100)], ids=["long-inputs", "many-short-inputs"])
def test_a_small_chat_is_not_queued_behind_a_huge_embedding_request(base_url, inputs, tokens):
    """12 embedding inputs of 500 tokens, or 60 of 100, are 6,000 prompt tokens; a 2-token chat
    sent while they run starts at the next step, not in the last input's step: long
    prompts leave a share of each step to short ones, and a request's later inputs wait behind
    other requests' first ones."""
    finished = {}

    def embed():
        status, _, _ = http(base_url, "POST", "/v1/embeddings",
                            {"model": MODEL, "input": [ids(tokens, 1000 + 11 * i) for i in range(inputs)]},
                            timeout=300)
        finished["embeddings"] = time.monotonic()
        return status

    def small_chat():
        time.sleep(0.5)
        status = chat(base_url, "Hello there", max_tokens=2)[0]
        finished["chat"] = time.monotonic()
        return status

    assert parallel(embed, small_chat) == [200, 200]
    assert finished["chat"] < finished["embeddings"], finished


def test_a_huge_request_runs_in_short_steps_on_the_cpu(base_url):
    """A step computes at most 32 prompt tokens on the CPU (64 where prompt rows take the AMX-BF16
    tiles; --max-num-prefill-tokens): a request that arrives while a huge one runs waits for the
    step in progress, and a step of 1,024 prompt tokens takes seconds on two cores. 4 embedding
    inputs of 100 tokens: while more than one is left, steps of at most the budget; the last one
    alone keeps no one waiting and may finish in one step (the server of this session serves
    nothing else meanwhile)."""
    budget = CPU_MAX_NUM_PREFILL_TOKENS_BF16 if bf16_tiles_ready() else CPU_MAX_NUM_PREFILL_TOKENS

    def steps() -> tuple[float, float]:
        name = "vllm:iteration_tokens_total_bucket"
        return metric(base_url, name, le=f"{budget}.0"), metric(base_url, name, le="+Inf")

    short_before, all_before = steps()
    inputs = [ids(100, 20_000 + 997 * i) for i in range(4)]
    assert http(base_url, "POST", "/v1/embeddings", {"model": MODEL, "input": inputs}, timeout=300)[0] == 200
    short_after, all_after = steps()
    assert all_after - all_before >= 300 / budget
    assert (all_after - all_before) - (short_after - short_before) <= 1


class GatedTokenizer:
    """The real tokenizer whose token_bytes_text (what the logprob formatter calls for every
    entry) waits at `gate` once `building` is set: a response that builds as long as the test wants."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.building, self.gate = threading.Event(), threading.Event()

    def token_bytes_text(self, token_id: int) -> str:
        self.building.set()
        self.gate.wait(60)
        return self._tokenizer.token_bytes_text(token_id)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_the_server_answers_while_a_logprob_response_is_built(start_server):
    """A response of many logprob entries (up to 131,072) took ~0.5 s of Python on the event loop,
    which every other request waited for (issue 24): it is built on a thread."""
    engines = []

    def gated_engine(checkpoint, config):
        engines.append(LLMEngine(checkpoint, config))
        engines[-1].tokenizer = GatedTokenizer(engines[-1].tokenizer)
        return engines[-1]

    url = start_server(engine_factory=gated_engine).url
    tokenizer = engines[0].tokenizer
    body = {"model": MODEL, "prompt": ids(8), "max_tokens": 1, "prompt_logprobs": 2}
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(http, url, "POST", "/v1/completions", body, timeout=120)
        try:
            assert tokenizer.building.wait(60)
            assert http(url, "GET", "/health", timeout=10)[0] == 200   # the event loop is free
            assert not reply.done()
        finally:
            tokenizer.gate.set()
        assert reply.result()[0] == 200


# --- the work before admission ----------------------------------------------------------------
class SlowTokenizer:
    """The real tokenizer, slowed down for marked or large texts: preparation that takes long."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def encode(self, text, *args, **kwargs):
        if SLOW_MARKER in text:
            time.sleep(SLOW_SECONDS)
        elif len(text) > LARGE_CHARS:
            time.sleep(LARGE_SECONDS)
        return self._tokenizer.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def slow_tokenizing_engine(checkpoint, config) -> LLMEngine:
    engine = LLMEngine(checkpoint, config)
    engine.tokenizer = SlowTokenizer(engine.tokenizer)
    return engine


@pytest.fixture(scope="module")
def slow(start_server):
    return start_server(engine_factory=slow_tokenizing_engine, max_waiting=2)


def test_requests_still_being_tokenized_count_toward_max_waiting(slow):
    """8 large texts that take 3 s each to tokenize, at once: 2 run on the 2 large-text threads, 2
    wait, the rest are refused as --max-waiting 2 refuses requests waiting for a sequence slot."""
    large = {"model": MODEL, "prompt": "word " * 30_000}
    results = parallel(*[lambda: http(slow.url, "POST", "/tokenize", large) for _ in range(8)])
    statuses = sorted(status for status, _, _ in results)
    assert statuses.count(200) >= 2 and statuses.count(503) >= 1, statuses
    refused = [(headers, raw) for status, headers, raw in results if status == 503]
    assert all(error_of(raw)["code"] == "server_overloaded" and "Retry-After" in headers for headers, raw in refused)


def test_a_small_request_is_not_queued_behind_large_tokenizations(slow):
    """4 /tokenize calls of 150 KB texts take both large-text threads for 6 s; a chat is tokenized
    on the small-text threads meanwhile."""
    large = {"model": MODEL, "prompt": "word " * 30_000}

    def small_chat():
        time.sleep(0.3)
        start = time.monotonic()
        status = chat(slow.url)[0]
        return status, time.monotonic() - start

    results = parallel(*[lambda: http(slow.url, "POST", "/tokenize", large)[0] for _ in range(4)], small_chat)
    assert results[:4] == [200] * 4
    status, seconds = results[4]
    assert status == 200 and seconds < LARGE_SECONDS - 0.5, seconds


def test_preparation_past_the_prepare_timeout_is_a_408(start_server):
    impatient = start_server(engine_factory=slow_tokenizing_engine, async_engine={"prepare_timeout": 0.5})
    status, _, raw = chat(impatient.url, f"{SLOW_MARKER} please")
    assert status == 408 and error_of(raw)["code"] == "timeout", raw[:300]
    assert chat(impatient.url)[0] == 200
