"""Schema fuzzer for the HTTP server: schemathesis draws requests from the server's own
/openapi.json (whatever it describes), sends each one, and holds every response to

- no 5xx, no timeout (a hang), no dropped connection;
- the spec: a documented status code, content type, headers and a body matching its schema;
- errors (>= 400) as OpenAI's JSON `{"error": {"message", "type", "param", "code"}}` (on /v1/messages
  Anthropic's `{"type": "error", "error": {"type", "message"}}`);
- a 200 event stream (stream=true) of well-formed events: chat / completion chunks ending with
  one `data: [DONE]`; Responses API events numbered in order, ending with one terminal event,
  each finished text equal to its deltas; Anthropic's message_start ... message_stop;

and, after the last case, the engine idle with every KV block free (GET /metrics), and (for a
server it spawned) no ERROR or traceback in the server's log.

    python tools/fuzz_http.py --cases 10000 --seed 1 --report fuzz.json           # spawns a server
    python tools/fuzz_http.py --url http://127.0.0.1:8000 --cases 2000            # a running one

Most cases go to the generation operations (a POST whose body has max_tokens, max_completion_tokens
or max_output_tokens: completions, chat, responses; --generation-share), split
into schema-valid and schema-violating ones (--negative-share). Each case is made cheap before it
is sent: those limits at most 4 (set when absent or null: a chat request would otherwise
generate up to the context length), n and best_of at most 2, at most 4 prompts.
A fraction gets the served model's name (the rest keep a random one: 404) and stream=true, and
half of the schema-valid ones an admissible prompt or conversation (--reach-share): most drawn
prompts are refused (empty, a 'tool' message without content), and their sampling fields would
never reach the engine.
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import shlex
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hypothesis
import jsonschema
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_shapes import error_body_problem, ndjson_problem, sse_data, stream_problem  # noqa: E402
from server_under_test import add_server_arguments, served, served_model, wait_idle  # noqa: E402

DEFAULT_SERVER_ARGS = "--max-model-len 256 --kv-cache-memory 64MiB"
# the fields that bound generated tokens, by API (completions; chat; responses)
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
CAPS = {**dict.fromkeys(LIMIT_FIELDS, 4), "n": 2, "best_of": 2}
OLLAMA_GENERATION = ("/api/chat", "/api/generate")   # bounded by options.num_predict; stream by default
LLAMACPP_GENERATION = ("/completion", "/completions")  # llama-server's: bounded by n_predict (-1: no bound)
NDJSON = "application/x-ndjson"
MAX_PROMPTS = 4
# prompts and conversations the server admits, for the cases made to reach the engine
ADMISSIBLE_PROMPTS = ["Hello", "The capital of France is", "1, 2, 3,", "def f(x):", "Über straße 🚀"]
ADMISSIBLE_CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Count to 3"}, {"role": "assistant", "content": "1, 2, 3"},
     {"role": "user", "content": "Again"}],
]
EXCERPT = 1500
SPEC_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
               response_headers_conformance, response_schema_conformance]


# ---------------------------------------------------------------- which cases

def _resolve(schema, root: dict):
    while isinstance(schema, dict) and str(schema.get("$ref", "")).startswith("#/"):
        node = root
        for part in schema["$ref"][2:].split("/"):
            node = node[part]
        schema = node
    return schema


def _properties(schema, root: dict, depth: int = 0) -> set[str]:
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or depth > 8:
        return set()
    names = set(schema.get("properties", {}))
    for key in ("allOf", "anyOf", "oneOf"):
        for part in schema.get(key, []):
            names |= _properties(part, root, depth + 1)
    return names


@functools.lru_cache(maxsize=None)
def limit_fields(operation) -> tuple[str, ...]:
    """The LIMIT_FIELDS its JSON request body declares."""
    content = operation.definition.raw.get("requestBody", {}).get("content", {})
    schemas = [media.get("schema", {}) for name, media in content.items() if "json" in name]
    declared = set().union(*[_properties(s, operation.schema.raw_schema) for s in schemas])
    return tuple(f for f in LIMIT_FIELDS if f in declared)


def is_generation(operation) -> bool:
    """A POST whose body bounds the tokens generated (completions, chat, responses, Ollama's)."""
    return operation.method.upper() == "POST" and (bool(limit_fields(operation)) or operation.path in
                                                   OLLAMA_GENERATION + LLAMACPP_GENERATION)


def operations_of(spec: dict) -> list:
    """The spec's operations as schemathesis reads them; one it cannot read is an error."""
    schema = schemathesis.openapi.from_dict(spec)
    operations = []
    for result in schema.get_all_operations():
        if not isinstance(result, Ok):
            raise RuntimeError(f"/openapi.json has an unreadable operation: {result.err()}")
        operations.append(result.ok())
    return operations


def draw(operation, mode: GenerationMode, count: int, seed: int) -> list:
    """Up to `count` cases of one operation (fewer when its inputs run out: a GET without
    parameters has one)."""
    if count <= 0:
        return []
    cases = []

    @hypothesis.seed(seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), verbosity=hypothesis.Verbosity.quiet)
    @hypothesis.given(operation.as_strategy(generation_mode=mode))
    def collect(case):
        if len(cases) < count:
            cases.append(case)

    try:
        collect()
    except hypothesis.errors.Unsatisfiable:   # nothing violates a schema without parameters
        pass
    return cases


def split(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights`, by largest remainder."""
    scale = sum(weights)
    exact = [total * w / scale for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[:total - sum(counts)]:
        counts[i] += 1
    return counts


def operation_weights(operations, generation_share: float) -> dict:
    """Each generation operation's share of the cases, and each other operation's."""
    generation = [op for op in operations if is_generation(op)]
    others = [op for op in operations if not is_generation(op)]
    share = 0.0 if not generation else 1.0 if not others else generation_share
    return {op: share / len(generation) if is_generation(op) else (1 - share) / len(others)
            for op in operations}


def case_batches(operations, total: int, generation_share: float, negative_share: float, seed: int,
                 batch_size: int = 200):
    """`total` cases in shuffled batches, drawn one batch at a time (the caller sends one while
    the next is drawn). An operation whose inputs run out (a GET without parameters has one
    case) is not drawn again: its share goes to the others."""
    weights = operation_weights(operations, generation_share)
    exhausted, drawn, rng = set(), 0, random.Random(seed)
    for batch_index in range(total):
        live = [op for op in operations if op not in exhausted and weights[op] > 0]
        size = min(batch_size, total - drawn)
        if not live or size <= 0:
            return
        batch = []
        for op, count in zip(live, split(size, [weights[op] for op in live])):
            negative, _ = split(count, [negative_share, 1 - negative_share])
            base = (seed * 1_000_003 + batch_index * 1009 + operations.index(op)) * 2
            cases = draw(op, GenerationMode.NEGATIVE, negative, base)
            cases += draw(op, GenerationMode.POSITIVE, count - len(cases), base + 1)
            if len(cases) < count:
                exhausted.add(op)
            batch += cases
        rng.shuffle(batch)
        drawn += len(batch)
        yield batch


# ---------------------------------------------------------------- making a case cheap

def _capped(value, cap: int, rng: random.Random):
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
        return type(value)(rng.randint(1, cap))
    return value


def _integral_floats_to_ints(value):
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return int(value)
    if isinstance(value, list):
        return [_integral_floats_to_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral_floats_to_ints(v) for k, v in value.items()}
    return value


def reach_engine(body: dict, rng: random.Random) -> None:
    """Make a schema-valid generation body admissible while keeping the sampling fields drawn:
    an admissible prompt, conversation or input, and 1 for 1.0 (JSON Schema counts 1.0 as an integer;
    the server may not). Otherwise most such bodies stop at validation (an empty prompt, a
    'tool' message without content) and the engine never sees the fuzzed sampling fields."""
    if "prompt" in body:
        body["prompt"] = rng.choice(ADMISSIBLE_PROMPTS)
    if "messages" in body:
        body["messages"] = json.loads(json.dumps(rng.choice(ADMISSIBLE_CONVERSATIONS)))
    if "input" in body:     # the Responses API
        body["input"] = rng.choice(ADMISSIBLE_PROMPTS)
    body.update(_integral_floats_to_ints(body))


def make_cheap(case, rng: random.Random, model: str | None, args) -> None:
    """Bound the work a generation case asks for, in place (see the module docstring); `model`:
    the served name, None when unknown (an API key is needed and was not given)."""
    share = args.model_share if model is not None else 0.0
    if isinstance((case.path_parameters or {}).get("model"), str) and rng.random() < share:
        case.path_parameters["model"] = model
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str) and rng.random() < share:
        body["model"] = model
    if not is_generation(case.operation):
        return
    positive = case.meta is not None and case.meta.generation.mode is GenerationMode.POSITIVE
    if positive and rng.random() < args.reach_share:
        reach_engine(body, rng)
    if case.operation.path in OLLAMA_GENERATION:
        _cap_ollama(body, rng)
        return
    if case.operation.path in LLAMACPP_GENERATION:
        _cap_llamacpp(body, rng, args)
        return
    for key, cap in CAPS.items():
        if key in body:
            body[key] = _capped(body[key], cap, rng)
    limits = limit_fields(case.operation)
    if all(body.get(f) is None for f in limits):   # absent or null: the default, up to the context length
        body[limits[0]] = rng.randint(1, CAPS[limits[0]])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        body["prompt"] = prompt[:MAX_PROMPTS]
    if "stream" not in body and rng.random() < args.stream_share:
        body["stream"] = True


def _cap_ollama(body: dict, rng: random.Random) -> None:
    """Ollama's token bound lives in options (absent or <= 0: up to the context length)."""
    options = body.setdefault("options", {})
    if not isinstance(options, dict):
        return
    limit = options.get("num_predict")
    if not isinstance(limit, int) or isinstance(limit, bool) or not 0 < limit <= CAPS["max_tokens"]:
        options["num_predict"] = rng.randint(1, CAPS["max_tokens"])


def _cap_llamacpp(body: dict, rng: random.Random, args) -> None:
    """llama-server's bound is n_predict (absent or < 0: up to the context length; 0: nothing)."""
    limit = body.get("n_predict")
    if not isinstance(limit, int) or isinstance(limit, bool) or not 0 <= limit <= CAPS["max_tokens"]:
        body["n_predict"] = rng.randint(1, CAPS["max_tokens"])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not any(isinstance(p, int) for p in prompt):
        body["prompt"] = prompt[:MAX_PROMPTS]
    if "stream" not in body and rng.random() < args.stream_share:
        body["stream"] = True


# ---------------------------------------------------------------- one case

@dataclass
class Outcome:
    operation: str
    mode: str
    generation: bool
    status: int | None = None
    error: str | None = None           # the message of a 4xx
    streamed: bool = False
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    request: dict | None = None
    response: dict | None = None


def _declared_media_types(spec: dict, operation, status: int) -> set[str]:
    responses = spec["paths"][operation.path][operation.method.lower()].get("responses", {})
    response = responses.get(str(status)) or responses.get(f"{str(status)[0]}XX") or responses.get("default") or {}
    if "$ref" in response:
        response = spec["components"]["responses"][response["$ref"].rsplit("/", 1)[-1]]
    return {media.split(";")[0].strip().lower() for media in response.get("content", {})}


def _is_ndjson(response: requests.Response) -> bool:
    return response.headers.get("Content-Type", "").split(";")[0].strip().lower() == NDJSON


def _is_event_stream(response: requests.Response) -> bool:
    return response.headers.get("Content-Type", "").split(";")[0].strip().lower() == "text/event-stream"


class ChunkSchemas:
    """Validators for stream chunks: the component schema whose `object` property is the chunk's
    `object` (e.g. "chat.completion.chunk"), when the spec has one. The spec's own description of
    a 200 is application/json; its event streams are checked chunk by chunk here."""

    def __init__(self, spec: dict):
        self.validators = {}
        for name, schema in spec.get("components", {}).get("schemas", {}).items():
            kind = schema.get("properties", {}).get("object", {}) if isinstance(schema, dict) else {}
            for value in [kind.get("const")] + list(kind.get("enum", [])):
                if isinstance(value, str):
                    root = {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
                    self.validators[value] = jsonschema.Draft202012Validator(root)

    def problem(self, stream_text: str) -> str | None:
        for data in sse_data(stream_text):
            try:
                chunk = json.loads(data)
            except ValueError:
                continue        # [DONE]; stream_problem() reports the rest
            validator = self.validators.get(chunk.get("object")) if isinstance(chunk, dict) else None
            error = validator and jsonschema.exceptions.best_match(validator.iter_errors(chunk))
            if error:
                where = "/".join(map(str, error.absolute_path))
                return f"stream chunk violates the spec's {chunk['object']} schema at '{where}': {error.message[:300]}"
        return None


class Checker:
    """Every problem with one response (see the module docstring). With allow_overload, a 503
    that says when to retry (Retry-After) is the server shedding load, not a server error."""

    def __init__(self, spec: dict, allow_overload: bool = False):
        self.spec = spec
        self.chunks = ChunkSchemas(spec)
        self.allow_overload = allow_overload

    def _spec_checks(self, case, response: requests.Response) -> list:
        checks = SPEC_CHECKS
        declared = _declared_media_types(self.spec, case.operation, response.status_code)
        if (_is_event_stream(response) and "text/event-stream" not in declared) or _is_ndjson(response):
            checks = [not_a_server_error, status_code_conformance]   # the spec says nothing about the stream
        if self.allow_overload and response.status_code == 503 and "Retry-After" in response.headers:
            checks = [c for c in checks if c is not not_a_server_error]
        return checks

    def problems(self, case, response: requests.Response) -> list[str]:
        problems = []
        try:
            case.validate_response(response, checks=self._spec_checks(case, response))
        except FailureGroup as group:
            problems += [f"{f.title}: {f.message}".strip() for f in group.exceptions]
        if response.status_code >= 400:
            problem = error_body_problem(response.content, case.operation.path)
            if problem:
                problems.append(problem)
        elif _is_event_stream(response):
            text = response.content.decode("utf-8", errors="replace")
            problems += [p for p in (stream_problem(text), self.chunks.problem(text)) if p]
        elif _is_ndjson(response):
            problem = ndjson_problem(response.content.decode("utf-8", errors="replace"))
            problems += [problem] if problem else []
        elif isinstance(case.body, dict) and case.body.get("stream") is True and response.status_code == 200 \
                and is_generation(case.operation) and case.operation.path not in OLLAMA_GENERATION:
            problems.append("stream=true answered without an event stream")
        return problems


def _excerpt(data) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, default=repr)
    return text if len(text) <= EXCERPT else text[:EXCERPT] + f"... ({len(text)} characters)"


_REQUESTS_DEFAULT_HEADERS = {"user-agent", "accept-encoding", "accept", "connection", "x-schemathesis-testcaseid"}


def request_of(case, base_url: str, headers: dict) -> dict:
    """requests.request() keyword arguments with the JSON body already encoded: as requests
    would, but NaN and Infinity go out as they are (the server must refuse them)."""
    kwargs = case.as_transport_kwargs(base_url=base_url, headers=headers)
    if "json" in kwargs:
        kwargs["data"] = json.dumps(kwargs.pop("json")).encode()
    return kwargs


def curl_of(kwargs: dict) -> str:
    """The request as a shell command."""
    url = requests.Request(kwargs["method"], kwargs["url"], params=kwargs.get("params")).prepare().url
    parts = ["curl", "-sS", "-X", kwargs["method"], shlex.quote(url)]
    for name, value in kwargs.get("headers", {}).items():
        if name.lower() not in _REQUESTS_DEFAULT_HEADERS:
            parts += ["-H", shlex.quote(f"{name}: {value}")]
    data = kwargs.get("data")
    if isinstance(data, str):
        data = data.encode()
    if data is not None:
        try:
            parts += ["--data-binary", shlex.quote(data.decode())]
        except UnicodeDecodeError:
            parts += ["--data-binary", "$'" + "".join(f"\\x{b:02x}" for b in data) + "'"]
    return " ".join(parts)


def _error_message(response: requests.Response) -> str | None:
    try:
        return str(response.json()["error"]["message"])[:100]
    except (ValueError, KeyError, TypeError):
        return None


def run_case(case, session: requests.Session, base_url: str, timeout: float, checker: Checker,
             headers: dict) -> Outcome:
    mode = case.meta.generation.mode.value if case.meta is not None else "?"
    outcome = Outcome(case.operation.label, mode, is_generation(case.operation))
    kwargs = request_of(case, base_url, headers)
    outcome.request = {"curl": _excerpt(curl_of(kwargs))}
    start = time.monotonic()
    try:
        response = session.request(**kwargs, timeout=timeout)
    except requests.Timeout:
        outcome.failures.append(f"no response within {timeout:g} s (a hang?)")
        return outcome
    except requests.RequestException as exc:
        outcome.failures.append(f"connection failed: {type(exc).__name__}: {exc}")
        return outcome
    finally:
        outcome.seconds = time.monotonic() - start
    outcome.status = response.status_code
    outcome.streamed = _is_event_stream(response)
    outcome.failures = checker.problems(case, response)
    if 400 <= response.status_code < 500:
        outcome.error = _error_message(response)
    if outcome.failures:
        outcome.response = {"status": response.status_code,
                            "content_type": response.headers.get("Content-Type"),
                            "body": _excerpt(response.content.decode("utf-8", errors="replace"))}
    return outcome


# ---------------------------------------------------------------- the run

def summarize(outcomes: list[Outcome], cases_asked: int, seconds: float, final_failures: list[str],
              warnings: list[str]) -> dict:
    per_operation: dict[str, Counter] = {}
    for o in outcomes:
        per_operation.setdefault(o.operation, Counter())[str(o.status)] += 1
    generated = [o for o in outcomes if o.generation and o.status == 200]
    failed = [o for o in outcomes if o.failures]
    kinds = Counter(f.split(":")[0] for o in failed for f in o.failures)
    rejections = Counter(f"{o.operation} {o.mode}: {o.error}" for o in outcomes if o.generation and o.error)
    return {
        "cases_asked": cases_asked, "cases": len(outcomes), "seconds": round(seconds, 1),
        "generation_cases": sum(o.generation for o in outcomes),
        "generated_200": len(generated), "streamed_200": sum(o.streamed for o in generated),
        "statuses_by_operation": {op: dict(sorted(c.items())) for op, c in sorted(per_operation.items())},
        "top_generation_rejections": dict(rejections.most_common(20)),
        "failed_cases": len(failed), "failure_kinds": dict(kinds.most_common()),
        "after_run_failures": final_failures,
        "server_python_warnings": warnings,
        "failures": [asdict(o) for o in failed],
    }


def fuzz(base_url: str, batches, spec: dict, model: str | None, args) -> list[Outcome]:
    """Send every case of every batch, `args.workers` at a time; batches are drawn meanwhile."""
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    local = threading.local()
    checker = Checker(spec, args.allow_overload)

    def one(case):
        if not hasattr(local, "session"):
            local.session = requests.Session()
        return run_case(case, local.session, base_url, args.timeout, checker, headers)

    futures = []
    with ThreadPoolExecutor(args.workers) as pool:
        for batch in batches:
            for case in batch:
                make_cheap(case, rng, model, args)
                futures.append(pool.submit(one, case))
            if args.progress:
                done = [f.result() for f in futures if f.done()]
                print(f"  {len(futures)} cases drawn, {len(done)} sent, "
                      f"{sum(bool(o.failures) for o in done)} failed", file=sys.stderr, flush=True)
        return [f.result() for f in futures]


def after_run_failures(server, timeout: float) -> list[str]:
    failures = []
    gauges = wait_idle(server.url, timeout)
    if not gauges.idle:
        failures.append(f"not idle {timeout:g} s after the last case: {gauges}")
    failures += [f"server log: {line}" for line in server.log_errors()[:20]]
    return failures


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_arguments(p, DEFAULT_SERVER_ARGS)
    p.add_argument("--cases", type=int, default=1000, help="requests to send")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generation-share", type=float, default=0.8,
                   help="fraction of the cases for the generation operations")
    p.add_argument("--negative-share", type=float, default=0.4,
                   help="fraction of each operation's cases that violate its schema")
    p.add_argument("--stream-share", type=float, default=0.3,
                   help="fraction of generation cases without 'stream' that get stream=true")
    p.add_argument("--reach-share", type=float, default=0.5,
                   help="fraction of schema-valid generation cases given an admissible prompt or "
                        "conversation (and 1 for 1.0), so that their sampling fields reach the engine")
    p.add_argument("--model-share", type=float, default=0.8,
                   help="fraction of cases with a 'model' that get the served model's name")
    p.add_argument("--workers", type=int, default=4, help="requests in flight at once")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a response may take")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds the engine may take to become idle after the last case")
    p.add_argument("--allow-overload", action="store_true",
                   help="a 503 with Retry-After is not a failure (for a server run with --max-waiting)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer <key>'")
    p.add_argument("--report", help="write the summary and every failing case (request and response) as JSON")
    p.add_argument("--progress", action="store_true", help="print progress after each batch of cases drawn")
    return p.parse_args(argv)


def print_summary(summary: dict) -> None:
    print(f"{summary['cases']} cases in {summary['seconds']} s (drawn and sent): {summary['generation_cases']} to the "
          f"generation endpoints, {summary['generated_200']} generated text ({summary['streamed_200']} streamed)")
    for op, statuses in summary["statuses_by_operation"].items():
        print(f"  {op:32s} {statuses}")
    print(f"{summary['failed_cases']} failing cases {summary['failure_kinds'] or ''}")
    for o in summary["failures"][:10]:
        print(f"- {o['operation']} ({o['mode']}): {o['failures'][0][:300]}\n    {o['request']['curl'][:400]}")
    for line in summary["after_run_failures"]:
        print(f"- {line[:300]}")
    for line in summary["server_python_warnings"][:5]:
        print(f"(the server printed a Python warning: {line[:300]})")


def main(argv=None) -> int:
    args = parse_args(argv)
    with served(args.url, shlex.split(args.server_args), args.server_log) as server:
        spec = requests.get(server.url + "/openapi.json", timeout=30).json()
        operations = operations_of(spec)
        batches = case_batches(operations, args.cases, args.generation_share, args.negative_share, args.seed)
        start = time.monotonic()
        outcomes = fuzz(server.url, batches, spec, served_model(server.url, args.api_key), args)
        seconds = time.monotonic() - start
        final = after_run_failures(server, args.idle_timeout)
        warnings = server.log_python_warnings()
    summary = summarize(outcomes, args.cases, seconds, final, warnings)
    print_summary(summary)
    if args.report:
        Path(args.report).write_text(json.dumps(summary, indent=1, ensure_ascii=False))
    return 1 if summary["failed_cases"] or final else 0


if __name__ == "__main__":
    sys.exit(main())
