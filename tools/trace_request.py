"""Trace one streamed chat request through the server's code, from HTTP body to tokens (issue 26's
measure of the server/engine layout): an in-process server on the default model, a profile hook on
every thread while one `stream: true` chat completion runs, counting

  files    the ember_cupy source files with a function called for the request;
  returns  the distinct (from file -> to file) pairs of a function returning into a caller of
           another ember_cupy file: every place where control goes back to a file it had left.
           nano-vllm's layout has a step return only to llm_engine.py.
The model's forward (model/, ops/, the weight formats) is the runner's business, not the
request's way through the server and engine: those files are left out unless --all.

  python tools/trace_request.py [--max-tokens 8] [--json out.json] [--list] [--all]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import Counter
from pathlib import Path

import ember_cupy

PACKAGE = Path(ember_cupy.__file__).resolve().parent
MODEL_FORWARD = ("model/", "ops/", "packed_weight.py", "quant.py", "gguf_values.py")


class FileTransitions:
    """A profile hook recording ember_cupy files called and cross-file returns."""

    def __init__(self, skip: tuple[str, ...] = ()):
        self.skip = skip
        self.files: Counter[str] = Counter()
        self.returns: Counter[tuple[str, str]] = Counter()
        self.lock = threading.Lock()
        self.active = True   # threads started under the hook keep it: stop() silences them

    def _name(self, frame) -> str | None:
        path = frame.f_code.co_filename
        if not path.startswith(str(PACKAGE)):
            return None
        name = path[len(str(PACKAGE)) + 1:]
        return None if name.startswith(self.skip) else name

    def __call__(self, frame, event, arg):
        if not self.active:
            return
        if event == "call":
            name = self._name(frame)
            if name:
                with self.lock:
                    self.files[name] += 1
        elif event == "return" and frame.f_back is not None:
            callee, caller = self._name(frame), self._name(frame.f_back)
            if callee and caller and callee != caller:
                with self.lock:
                    self.returns[(callee, caller)] += 1

    def start(self):
        threading.setprofile(self)
        sys.setprofile(self)

    def stop(self):
        self.active = False
        sys.setprofile(None)
        threading.setprofile(None)


def _one_streamed_chat(url: str, max_tokens: int) -> str:
    import urllib.request
    body = json.dumps({"model": "default", "stream": True, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": "Name three colors."}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read().decode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", help="write the counts here")
    parser.add_argument("--list", action="store_true", help="print every file and return edge")
    parser.add_argument("--all", action="store_true", help="count the model's forward (model/, ops/) too")
    args = parser.parse_args()
    from ember_cupy.config import EngineConfig
    from ember_cupy.engine.llm_engine import LLMEngine
    from ember_cupy.model.loader import load_checkpoint
    from ember_cupy.server import AsyncEngine, BackgroundServer, EngineMetrics, ServerSettings
    checkpoint = load_checkpoint(None)
    engine = AsyncEngine(LLMEngine(checkpoint, EngineConfig(num_kv_blocks=64, max_model_len=1024)),
                         metrics=EngineMetrics("default"))
    hook = FileTransitions(() if args.all else MODEL_FORWARD)
    threading.setprofile(hook)   # threads the server starts from here on are traced
    server = BackgroundServer(engine, ServerSettings(host="127.0.0.1", port=0, served_model_names=["default"])).start()
    try:
        _one_streamed_chat(server.url, 1)           # warm-up (first-use compiles, caches), not counted
        hook.files.clear()
        hook.returns.clear()
        sys.setprofile(hook)
        text = _one_streamed_chat(server.url, args.max_tokens)
        hook.stop()
    finally:
        server.stop()
    assert "[DONE]" in text, text[-500:]
    result = {"files": len(hook.files), "returns": len(hook.returns),
              "file_list": sorted(hook.files), "return_edges": sorted(f"{a} -> {b}" for a, b in hook.returns)}
    print(f"one streamed chat request, {args.max_tokens} tokens: {result['files']} files, "
          f"{result['returns']} distinct cross-file returns")
    if args.list:
        print("\n".join(["files:", *result["file_list"], "returns:", *result["return_edges"]]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
