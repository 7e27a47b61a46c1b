"""Trace one streamed chat request through the server's code, from HTTP body to tokens (issue 26's
measure of the server/engine layout): an in-process server on the default model, a profile hook on
every thread while one `stream: true` chat completion runs, counting

  files    the ember_cupy source files with a function called for the request;
  returns  the distinct (from file -> to file) pairs of a function returning into a caller of
           another ember_cupy file: every place where control goes back to a file it had left;
  ping-pong  pairs of files that each return into the other.
           nano-vllm's layout has a step return only to llm_engine.py.
The model's forward (model/, ops/, the weight formats) is the runner's business, not the
request's way through the server and engine: those files are left out unless --all. Reading a
property of an ember_cupy class (`seq.num_tokens`, `params.greedy`) is reading an attribute,
though the profiler sees a call: such reads are not counted unless --count-properties (both
counts are printed).

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
        self.data_reads: set = set()   # code objects whose calls are attribute reads
        self.files: Counter[tuple[str, bool]] = Counter()                 # (file, a property read)
        self.returns: Counter[tuple[str, str, bool]] = Counter()         # (from, to, a property read)
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
                    self.files[(name, frame.f_code in self.data_reads)] += 1
        elif event == "return" and frame.f_back is not None:
            callee, caller = self._name(frame), self._name(frame.f_back)
            if callee and caller and callee != caller:
                with self.lock:
                    self.returns[(callee, caller, frame.f_code in self.data_reads)] += 1

    def counted(self, properties: bool) -> tuple[list[str], list[str]]:
        """The files called and the return edges, property reads among them or not."""
        files = sorted({name for name, read in self.files if properties or not read})
        edges = sorted({f"{a} -> {b}" for a, b, read in self.returns if properties or not read})
        return files, edges

    def start(self):
        threading.setprofile(self)
        sys.setprofile(self)

    def stop(self):
        self.active = False
        sys.setprofile(None)
        threading.setprofile(None)


def property_getters() -> set:
    """The code of every property getter of the ember_cupy classes imported so far."""
    codes = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("ember_cupy"):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                codes |= {attr.fget.__code__ for attr in vars(value).values()
                          if isinstance(attr, property) and attr.fget is not None}
    return codes


def ping_pong(edges: list[str]) -> list[str]:
    """Pairs of files that each return into the other: control going back and forth between two
    files (the issue's serving.py <-> responses.py), rather than from helpers back to the one file
    that orchestrates them."""
    pairs = {tuple(edge.split(" -> ")) for edge in edges}
    return sorted(f"{a} <-> {b}" for a, b in pairs if (b, a) in pairs and a < b)


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
    parser.add_argument("--count-properties", action="store_true",
                        help="list property reads as calls (both counts are printed either way)")
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
        hook.data_reads = property_getters()
        hook.files.clear()
        hook.returns.clear()
        sys.setprofile(hook)
        text = _one_streamed_chat(server.url, args.max_tokens)
        hook.stop()
    finally:
        server.stop()
    assert "[DONE]" in text, text[-500:]
    files, edges = hook.counted(args.count_properties)
    all_files, all_edges = hook.counted(True)
    result = {"files": len(files), "returns": len(edges), "file_list": files, "return_edges": edges,
              "with_property_reads": {"files": len(all_files), "returns": len(all_edges)},
              "ping_pong": ping_pong(edges)}
    print(f"one streamed chat request, {args.max_tokens} tokens: {result['files']} files, "
          f"{result['returns']} distinct cross-file returns"
          + ("" if args.count_properties else f" ({len(all_files)} files, {len(all_edges)} returns "
                                             "counting property reads as calls)"))
    print(f"files returning into each other (ping-pong): {len(result['ping_pong'])} {result['ping_pong']}")
    if args.list:
        print("\n".join(["files:", *result["file_list"], "returns:", *result["return_edges"]]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
