"""Record llama.cpp's own llama-server answering its native routes on the default model, for
tests/server/test_llamacpp_api.py to hold ember-cupy's answers to: the fields (and their JSON
types) of /completion's result, of its streamed events and of its completion_probabilities, the
llama-server fields of /props, /tokenize's ids and pieces, /detokenize's text and /apply-template's
prompt. Texts generated are not recorded (two engines' arithmetic may pick another greedy token).

    python tools/make_llamacpp_api_fixture.py     # builds llama-server if missing (tools/llamacpp.py)
"""
from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp import ensure_llama_server, llama_server_version, running_llama_server  # noqa: E402

from ember_cupy.model.loader import resolve_model_path  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llamacpp_api.json"
PROMPT = "The capital of France is"
TOKENIZED = ["Hello world<|im_end|>", "Hi \u00e1\U0001F680 ok"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def _request(url: str, path: str, body: dict | None = None) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read()


def json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def shape(obj: dict) -> dict[str, str]:
    """Each field of obj -> its JSON type."""
    return {key: json_type(value) for key, value in sorted(obj.items())}


def record(url: str) -> dict:
    greedy = {"prompt": PROMPT, "n_predict": 4, "temperature": 0}
    result = json.loads(_request(url, "/completion", {**greedy, "n_probs": 2, "return_tokens": True}))
    probability = result["completion_probabilities"][0]
    raw = _request(url, "/completion", {**greedy, "stream": True}).decode()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    props = json.loads(_request(url, "/props"))
    return {
        "completion": shape(result), "timings": shape(result["timings"]), "probability": shape(probability),
        "top_probability": shape(probability["top_logprobs"][0]),
        "stream_event": shape(events[0]), "stream_last": shape(events[-1]),
        "stream_stops": [e["stop"] for e in events],
        "props": shape({k: props[k] for k in ("default_generation_settings", "total_slots", "model_path",
                                                "chat_template", "bos_token", "eos_token", "build_info")}),
        "tokenize": {text: json.loads(_request(url, "/tokenize", {"content": text}))["tokens"] for text in TOKENIZED},
        "pieces": {text: json.loads(_request(url, "/tokenize", {"content": text, "with_pieces": True}))["tokens"]
                   for text in TOKENIZED},
        "detokenize": json.loads(_request(url, "/detokenize", {"tokens": json.loads(_request(
            url, "/tokenize", {"content": TOKENIZED[1]}))["tokens"]})),
        "apply_template": json.loads(_request(url, "/apply-template", {"messages": MESSAGES})),
    }


def main() -> int:
    model = resolve_model_path(None)
    with running_llama_server(model, 1024) as url:
        recorded = record(url)
    fixture = {"description": "llama.cpp's llama-server on the default model: fields and JSON types of its "
                              "native routes' answers, tokenizer answers, the applied template "
                              "(tools/make_llamacpp_api_fixture.py)",
               "model": Path(model).name, "prompt": PROMPT, "messages": MESSAGES,
               "llama_server": llama_server_version(ensure_llama_server()), **recorded}
    OUT.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
