"""Run a call on a fresh thread with a large stack: llguidance compiles grammars recursively.

Rust code called from Python runs on the calling thread's stack (8 MiB on Linux), and a chain of
rules or `$ref`s costs a frame per link: measured on llguidance 1.9, a Lark chain `a: b` takes
~3.1 KiB of stack per rule (the densest shape found: ~10 bytes of grammar per rule), a `$defs`
chain of objects ~9.2 KiB per link (~70 bytes of schema). 8 MiB overflows at ~2,650 Lark rules
(56 KiB of grammar) or ~1,250 `anyOf`/`$ref` links (75 KiB of schema), and the overflow is a
SIGSEGV that kills the whole server. The largest constraint accepted (MAX_SPEC_CHARS, 1 MiB) holds
~100,000 such rules: ~310 MiB of stack. STACK_BYTES reserves 1 GiB, over 3x that; it is address
space, not memory: only the pages the compile touches become resident, and they go back when the
thread exits (a thread per call: glibc keeps no cached stack this large).
"""
from __future__ import annotations

import threading

STACK_BYTES = 1 << 30
_stack_size_lock = threading.Lock()   # threading.stack_size is process-wide: set it, start, restore


def call_with_large_stack(fn, *args):
    """fn(*args) on a new thread with a STACK_BYTES stack; its result, or what it raised."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:   # re-raised on the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="ember-grammar-compile", daemon=True)
    with _stack_size_lock:
        previous = threading.stack_size(STACK_BYTES)
        try:
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
