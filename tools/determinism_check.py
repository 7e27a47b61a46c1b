"""Determinism through the HTTP server, as SGLang tests its deterministic mode: in each of three
modes a target request runs N times, greedy and seeded at temperature 1, and its completions
(text, token logprobs and top-5 logprobs) are compared bit for bit. Expected: one distinct output
per mode and sampling.

- alone:  the target N times, one after the other (the first computes its prompt, the others
          find all of it in the prefix cache);
- mixed:  the target among a random batch of 1-15 (--max-others) other requests (random prompts, lengths,
          sampling), all sent at once;
- prefix: a fresh cache_salt per trial: first a primer sharing the target's first L tokens (L
          random), then the target, so the prefix cache covers a random fraction of its prompt.

    python tools/determinism_check.py --trials 50 --report determinism.json     # spawns a server
    python tools/determinism_check.py --url http://127.0.0.1:8000 --trials 10
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_under_test import add_server_arguments, served, served_model  # noqa: E402

DEFAULT_SERVER_ARGS = "--max-model-len 1024 --kv-cache-memory 256MiB"
MODES = ("alone", "mixed", "prefix")
SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 1.0, "seed": 1234}}


def random_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1000, 20000) for _ in range(count)]


def complete(url: str, body: dict, timeout: float) -> dict:
    response = requests.post(url + "/v1/completions", json=body, timeout=timeout)
    if response.status_code != 200:
        raise RuntimeError(f"/v1/completions: {response.status_code} {response.text[:300]}")
    return response.json()


def signature(reply: dict) -> str:
    """What must be the same bits every time: the text and every logprob the server reports."""
    choice = reply["choices"][0]
    logprobs = choice["logprobs"]
    return json.dumps([choice["text"], logprobs["token_logprobs"], logprobs["top_logprobs"]])


class Check:
    def __init__(self, url: str, model: str, args):
        self.url, self.model, self.args = url, model, args
        self.rng = random.Random(args.seed)
        self.target = random_ids(self.rng, args.prompt_tokens)

    def body(self, prompt: list[int], sampling: dict, max_tokens: int, salt: str | None = None) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "logprobs": 5,
                "ignore_eos": True, **sampling}
        return body if salt is None else {**body, "cache_salt": salt}

    def target_body(self, sampling: str, salt: str) -> dict:
        return self.body(self.target, SAMPLINGS[sampling], self.args.max_tokens, salt)

    def alone(self, sampling: str, trial: int) -> str:
        return signature(complete(self.url, self.target_body(sampling, f"alone-{sampling}"), self.args.timeout))

    def mixed(self, sampling: str, trial: int) -> str:
        others = [self.body(random_ids(self.rng, self.rng.randint(4, self.args.prompt_tokens)),
                            {"temperature": self.rng.choice([0, 0.7, 1.0]), "seed": self.rng.randrange(1 << 30)},
                            self.rng.randint(2, 2 * self.args.max_tokens))
                  for _ in range(self.rng.randint(1, self.args.max_others))]
        bodies = others + [self.target_body(sampling, f"mixed-{sampling}-{trial}")]
        self.rng.shuffle(bodies)
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda b: complete(self.url, b, self.args.timeout), bodies))
        return next(signature(r) for b, r in zip(bodies, replies) if b.get("cache_salt", "").startswith("mixed-"))

    def prefix(self, sampling: str, trial: int) -> str:
        salt = f"prefix-{sampling}-{trial}"
        shared = self.rng.randint(1, len(self.target) - 1)
        primer = self.target[:shared] + random_ids(self.rng, self.rng.randint(1, 16))
        complete(self.url, self.body(primer, {"temperature": 0}, 1, salt), self.args.timeout)
        return signature(complete(self.url, self.target_body(sampling, salt), self.args.timeout))

    def run(self, mode: str, sampling: str) -> dict:
        outputs = [getattr(self, mode)(sampling, trial) for trial in range(self.args.trials)]
        return {"mode": mode, "sampling": sampling, "trials": len(outputs), "distinct": len(set(outputs))}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_arguments(p, DEFAULT_SERVER_ARGS)
    p.add_argument("--trials", type=int, default=50, help="runs of the target per mode and sampling")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--prompt-tokens", type=int, default=300, help="length of the target prompt")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens the target generates")
    p.add_argument("--max-others", type=int, default=15, help="most other requests beside the target (mixed)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts, batches and prefix lengths")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a response may take")
    p.add_argument("--report", help="write the results as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with served(args.url, shlex.split(args.server_args), args.server_log) as server:
        check = Check(server.url, served_model(server.url), args)
        results = [check.run(mode, sampling) for mode in args.modes for sampling in SAMPLINGS]
    for r in results:
        print(f"{r['mode']:7s} {r['sampling']:7s} {r['trials']:3d} trials: {r['distinct']} distinct output(s)")
    if args.report:
        Path(args.report).write_text(json.dumps(results, indent=1))
    return 0 if all(r["distinct"] == 1 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
