"""A server starts without importing the Responses and Messages APIs or the OpenAPI spec's models
(~50 ms of pydantic models off every start, ember_cupy/server/api.py: _BuiltAtFirstRequest); the
first request to each imports and serves it. Run in a fresh interpreter, whose sys.modules shows
what the start imported."""
import json
import subprocess
import sys

SCRIPT = r"""
import json, sys, urllib.request
from ember_cupy.config import EngineConfig
from ember_cupy.engine.llm_engine import LLMEngine
from ember_cupy.server import AsyncEngine, BackgroundServer, EngineMetrics, ServerSettings

DEFERRED = ["ember_cupy.server.protocol.anthropic", "ember_cupy.server.protocol.responses_api",
            "ember_cupy.server.protocol.replies", "ember_cupy.server.openapi"]
engine = AsyncEngine(LLMEngine(None, EngineConfig(num_kv_blocks=64)), metrics=EngineMetrics("m"))
server = BackgroundServer(engine, ServerSettings(host="127.0.0.1", port=0, served_model_names=["m"])).start()

def post(path, body):
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)

try:
    urllib.request.urlopen(server.url + "/health", timeout=60).read()
    report = {"at_start": [m for m in DEFERRED if m in sys.modules]}
    report["response"] = post("/v1/responses", {"model": "m", "input": "Hi", "max_output_tokens": 3})["status"]
    report["message"] = post("/v1/messages", {"model": "m", "max_tokens": 3,
                                              "messages": [{"role": "user", "content": "Hi"}]})["type"]
    report["tokens"] = post("/v1/messages/count_tokens", {"model": "m",
                                                          "messages": [{"role": "user", "content": "Hi"}]})
    with urllib.request.urlopen(server.url + "/openapi.json", timeout=60) as response:
        report["openapi_paths"] = sorted(json.load(response)["paths"])
    report["after"] = [m for m in DEFERRED if m in sys.modules]
finally:
    server.stop()
print(json.dumps(report))
"""


def test_the_responses_and_messages_apis_are_imported_at_their_first_request():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["at_start"] == []
    assert report["response"] in ("completed", "incomplete")
    assert report["message"] == "message"
    assert report["tokens"]["input_tokens"] > 0
    assert {"/v1/responses", "/v1/messages"} <= set(report["openapi_paths"])
    assert len(report["after"]) == 4
