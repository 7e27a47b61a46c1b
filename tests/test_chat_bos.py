"""BOS exactly once: chat prompts are encoded without adding the special tokens the template has
already written (as vLLM does), through every way in; tokenizer.json post-processors honoured."""
import json
import urllib.request

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from ember_cupy import LLM, SamplingParams
from ember_cupy.config import EngineConfig
from ember_cupy.engine.input_processor import InputProcessor
from ember_cupy.engine.llm_engine import LLMEngine
from tiny_model import VOCAB, write_tiny_checkpoint

BOS = VOCAB.index("<s>")
BOS_TEMPLATE = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "w1 w2"}]


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    """A tiny HF checkpoint whose tokenizer adds BOS (add_bos_token) and whose template writes it."""
    path = tmp_path_factory.mktemp("bos_model")
    write_tiny_checkpoint(path)
    _make_special(path)
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                   "chat_template": BOS_TEMPLATE}, f)
    return str(path)


@pytest.fixture(scope="module")
def engine(bos_model):
    return LLMEngine(bos_model, EngineConfig(num_kv_blocks=64, block_size=4))


def _make_special(path):
    """<s> and </s> as special tokens of tokenizer.json, so the rendered '<s>' is one token."""
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))


def _one_bos(ids):
    return ids[0] == BOS and BOS not in ids[1:]


def test_plain_prompts_still_get_their_bos(engine):
    ids = engine.tokenizer.encode("w1 w2")
    assert ids == [BOS, VOCAB.index("w1"), VOCAB.index("w2")]


def test_encoding_a_rendered_chat_adds_no_second_bos(engine):
    prompt = engine.tokenizer.apply_chat_template(MESSAGES)
    assert prompt.startswith("<s>")
    assert _one_bos(engine.tokenizer.encode(prompt, add_special_tokens=False))
    assert engine.tokenizer.encode(prompt)[:2] == [BOS, BOS]   # when asked (the default, for plain text)


def test_llm_chat_prompt_has_one_bos(bos_model):
    llm = LLM(bos_model, num_kv_blocks=64, block_size=4)
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=1, temperature=0))[0]
    assert _one_bos(out.prompt_token_ids), out.prompt_token_ids


def test_cli_chat_prompt_has_one_bos(bos_model, monkeypatch, capsys):
    from ember_cupy import cli
    seen = []
    original = InputProcessor._prompt_ids

    def recording(self, prompt, *args):
        text, ids = original(self, prompt, *args)
        seen.append(ids)
        return text, ids

    lines = iter(["w1 w2"])

    def fake_input(_prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(InputProcessor, "_prompt_ids", recording)
    monkeypatch.setattr("builtins.input", fake_input)
    assert cli.main(["chat", "--model", bos_model, "--max-tokens", "1", "--no-progress",
                     "--num-kv-blocks", "64", "--block-size", "4"]) == 0
    assert len(seen) == 1 and _one_bos(seen[0]), seen


def _post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def served(engine):
    from ember_cupy.server import AsyncEngine, BackgroundServer, EngineMetrics, ServerSettings
    settings = ServerSettings(host="127.0.0.1", port=0, served_model_names=["tiny"])
    server = BackgroundServer(AsyncEngine(engine, metrics=EngineMetrics("tiny")), settings).start()
    yield server.url
    server.stop()


def test_http_chat_and_tokenize_count_one_bos(served, engine):
    expected = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert _one_bos(expected)
    tokenized = _post(served + "/tokenize", {"messages": MESSAGES})
    assert tokenized["tokens"] == expected
    chat = _post(served + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == len(expected)
    plain = _post(served + "/tokenize", {"prompt": "w1 w2"})
    assert plain["tokens"] == [BOS, VOCAB.index("w1"), VOCAB.index("w2")]


def test_tokenizer_json_template_processing_bos_is_added(tmp_path):
    """The Llama-3 HF layout: BOS comes from tokenizer.json's post-processor, and
    tokenizer_config.json says nothing about add_bos_token."""
    write_tiny_checkpoint(tmp_path)
    _make_special(tmp_path)
    tok = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS)])
    tok.save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": BOS_TEMPLATE}, f)
    from ember_cupy.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_hf_directory(str(tmp_path))
    w1, w2 = VOCAB.index("w1"), VOCAB.index("w2")
    assert tokenizer.encode("w1 w2") == [BOS, w1, w2]
    assert tokenizer.encode("w1 w2", add_special_tokens=False) == [w1, w2]
    assert tokenizer.add_bos_token
    assert _one_bos(tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False))
