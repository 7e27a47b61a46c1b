"""`ember-cupy generate | chat | info`: the engine in this process, no server."""
from __future__ import annotations

import os
import sys
import time

from ember_cupy.cli import loading


def _sampling(args):
    from ember_cupy.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))


def _stream(engine, request_id: str, prompt, params, out=None, add_special_tokens: bool = True) -> tuple[int, float]:
    """Run one request, printing text as it comes; returns (tokens, seconds)."""
    out = out or sys.stdout
    start = time.monotonic()
    engine.add_request(request_id, prompt, params, add_special_tokens=add_special_tokens)
    tokens = 0
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                completion = output.outputs[0]
                tokens += len(completion.delta_token_ids)
                out.write(completion.delta_text)
                out.flush()
    except KeyboardInterrupt:
        engine.abort(request_id)
        out.write(" [interrupted]")
    out.write("\n")
    return tokens, time.monotonic() - start


def cmd_generate(args) -> int:
    params = _sampling(args)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    engine = loading.load_engine(args)
    tokens, seconds = _stream(engine, "generate-0", prompt, params)
    print(f"[{tokens} tokens in {seconds:.2f}s, {tokens / max(seconds, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


CHAT_HISTORY = os.path.join("~", ".cache", "ember_cupy", "chat_history")


def _line_editing(path: str):
    """readline for input(): arrow keys, editing, history (kept in `path` between sessions).
    Returns the function that saves the history, or None where readline is missing."""
    try:
        import readline
    except ImportError:   # Windows without pyreadline: plain input()
        return None
    path = os.path.expanduser(path)
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save() -> None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass
    return save


def cmd_chat(args) -> int:
    params = _sampling(args)
    engine = loading.load_engine(args)
    save_history = _line_editing(CHAT_HISTORY)
    try:
        return _chat_loop(engine, args.system, params)
    finally:
        if save_history:
            save_history()


def _chat_loop(engine, system_prompt: str | None, params) -> int:
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages = list(system)
    print("chat with the model; /reset clears the conversation, Ctrl-D quits", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = list(system)
            print("[conversation reset" + (": the system message is kept]" if system else "]"), file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        reply = _Capture(sys.stdout)
        _stream(engine, f"chat-{turn}", prompt, params, out=reply, add_special_tokens=False)
        messages.append({"role": "assistant", "content": reply.text})
        turn += 1


class _Capture:
    def __init__(self, out):
        self.out, self.text = out, ""

    def write(self, text: str) -> None:
        if text != "\n" or self.text:
            self.text += text
        self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def cmd_info() -> int:
    import json
    from ember_cupy.info import runtime_info
    print(json.dumps(runtime_info(), indent=2))
    return 0

