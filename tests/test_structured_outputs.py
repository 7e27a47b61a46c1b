"""Constrained decoding through the Python API on the real default model: every output of a JSON
schema, regex, choice or Lark grammar matches it, greedy and sampled, with n > 1, preemption,
prefix caching, stop strings, logprobs and streaming; bad constraints are ValueErrors."""
import json
import re

import jsonschema
import pytest

from ember_cupy import LLM, SamplingParams
from ember_cupy.structured import StructuredOutputsParams

SEEDS = (1, 2, 3)

SCHEMAS = {
    "nested_object": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "int_array_2_to_4": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                         "minItems": 2, "maxItems": 4},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
             "required": ["color"], "additionalProperties": False},
    "const": {"type": "object", "properties": {"version": {"const": 2}, "kind": {"const": "point"}},
              "required": ["version", "kind"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"], "additionalProperties": False},
    "formats": {"type": "object", "properties": {
        "day": {"type": "string", "format": "date"},
        "id": {"type": "string", "format": "uuid"}},
        "required": ["day", "id"], "additionalProperties": False},
    "number_bounds": {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -10.5, "maximum": 40},
        "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["celsius", "count"], "additionalProperties": False},
    "optional_fields": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 20},
        "subtitle": {"type": "string", "maxLength": 20},
        "pages": {"type": "integer", "minimum": 1, "maximum": 999}},
        "required": ["title"], "additionalProperties": False},
    "ref_defs": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -99, "maximum": 99},
        "y": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False},
    "object_array_1_to_3": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "done": {"type": "boolean"}},
        "required": ["id", "done"], "additionalProperties": False}},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999},
                         {"type": "object", "properties": {"error": {"type": "string", "maxLength": 16}},
                          "required": ["error"], "additionalProperties": False}]},
    "nullable": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                  "note": {"type": ["string", "null"], "maxLength": 12}},
                 "required": ["ok", "note"], "additionalProperties": False},
    "string_length": {"type": "string", "minLength": 3, "maxLength": 8},
}


def json_params(schema, **sampling) -> SamplingParams:
    return SamplingParams(max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema), **sampling)


def chat_prompt(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])   # SmolLM2 adds no BOS either way


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, max_num_seqs=64)


def assert_valid(text: str, schema: dict, finish_reason: str) -> None:
    assert finish_reason == "stop", f"unfinished ({finish_reason}): {text!r}"
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_schema_suite_greedy_and_sampled(llm):
    """Every schema at temperature 0 and at temperature 1 with several seeds, in one batch."""
    prompts, params, names = [], [], []
    for name, schema in SCHEMAS.items():
        prompt = chat_prompt(llm, f"Reply with JSON for this schema: {json.dumps(schema)}")
        for sampling in [dict(temperature=0.0)] + [dict(temperature=1.0, seed=s) for s in SEEDS]:
            prompts.append(prompt)
            params.append(json_params(schema, **sampling))
            names.append(name)
    outputs = llm.generate(prompts, params)
    for name, output in zip(names, outputs):
        completion = output.outputs[0]
        assert_valid(completion.text, SCHEMAS[name], completion.finish_reason)
    assert not llm.engine.has_unfinished_requests()


def test_json_object_regex_choice_grammar(llm):
    lark = 'start: greeting " " name "!"\ngreeting: "Hello" | "Hi"\nname: /[A-Z][a-z]{1,8}/\n'
    # any JSON object has unbounded strings, which a sampling 135M model may not close within
    # max_tokens: that one runs greedy only
    greedy_only = StructuredOutputsParams(json_object=True)
    cases = [
        (greedy_only, lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        (StructuredOutputsParams(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
        (StructuredOutputsParams(grammar=lark), lambda t: re.fullmatch(r"(Hello|Hi) [A-Z][a-z]{1,8}!", t)),
        (StructuredOutputsParams(grammar='root ::= "A" [0-9] [0-9]'), lambda t: re.fullmatch(r"A[0-9]{2}", t)),
    ]
    prompts, params, checks = [], [], []
    for constraint, check in cases:
        sampled = [] if constraint is greedy_only else [dict(temperature=1.0, seed=s) for s in SEEDS]
        for sampling in [dict(temperature=0.0)] + sampled:
            prompts.append(chat_prompt(llm, "Say something."))
            params.append(SamplingParams(max_tokens=48, structured_outputs=constraint, **sampling))
            checks.append(check)
    for check, output in zip(checks, llm.generate(prompts, params)):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop" and check(completion.text), completion.text


def test_n_forks_each_follow_the_grammar_with_their_own_state(llm):
    schema = SCHEMAS["nested_object"]
    output = llm.generate(chat_prompt(llm, "A person as JSON."),
                          json_params(schema, n=4, temperature=1.0, seed=11))[0]
    assert len(output.outputs) == 4
    for completion in output.outputs:
        assert_valid(completion.text, schema, completion.finish_reason)
    assert len({c.text for c in output.outputs}) > 1   # the children sampled apart


def test_seeded_output_is_reproducible_and_batch_independent(llm):
    schema = SCHEMAS["object_array_1_to_3"]
    prompt = chat_prompt(llm, "A todo list as JSON.")
    alone = llm.generate(prompt, json_params(schema, temperature=1.0, seed=5))[0].outputs[0].text
    batched = llm.generate([prompt, chat_prompt(llm, "Hello")],
                           [json_params(schema, temperature=1.0, seed=5), SamplingParams(max_tokens=8)])
    assert batched[0].outputs[0].text == alone


def test_preemption_and_prefix_caching_keep_the_grammar(make_llm):
    """A KV pool too small for every sequence at once preempts (recompute keeps the output and
    so the matcher); a repeated prompt hits the prefix cache. The outputs equal a roomy run's."""
    schema = SCHEMAS["ref_defs"]
    prompt_text = "Two points as JSON, please, with small coordinates."
    roomy = make_llm(max_num_seqs=8)
    prompt = chat_prompt(roomy, prompt_text)
    params = [json_params(schema, temperature=1.0, seed=s) for s in range(6)]
    want = [o.outputs[0].text for o in roomy.generate([prompt] * 6, params)]
    tight = make_llm(max_num_seqs=8, num_kv_blocks=12, block_size=16)
    outputs = tight.generate([prompt] * 6, params)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert any(o.num_cached_tokens > 0 for o in outputs)
    assert [o.outputs[0].text for o in outputs] == want
    for output in outputs:
        assert_valid(output.outputs[0].text, schema, output.outputs[0].finish_reason)


def test_stop_string_cuts_constrained_output(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=['"age"'],
                            structured_outputs=StructuredOutputsParams(json=SCHEMAS["nested_object"]))
    completion = llm.generate(chat_prompt(llm, "A person as JSON."), params)[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == '"age"'
    assert completion.text.startswith('{"user": {"name": "') and '"age"' not in completion.text


def test_logprobs_are_raw_and_tokens_follow_the_mask(llm):
    """The mask decides the token; the logprobs reported stay the model's own (vLLM's raw mode
    of ember's sampler): the top alternatives include tokens the grammar forbade."""
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3,
                            structured_outputs=StructuredOutputsParams(choice=["Zebra", "Quokka"]))
    completion = llm.generate(chat_prompt(llm, "Hello!"), params)[0].outputs[0]
    assert completion.text in ("Zebra", "Quokka")
    first = completion.logprobs[0]
    allowed_first = {llm.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("Zebra", "Quokka", "Z", "Q")}
    assert any(token not in allowed_first for token, _ in first.top)
    assert first.logprob <= first.top[0][1]


def test_streamed_deltas_add_up_to_valid_json(llm):
    engine = llm.engine
    schema = SCHEMAS["optional_fields"]
    engine.add_request("stream-1", chat_prompt(llm, "A book as JSON."), json_params(schema, temperature=0.0))
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            pieces.append(output.outputs[0].delta_text)
            final = output
    assert final.finished and len([p for p in pieces if p]) > 1
    assert "".join(pieces) == final.outputs[0].text
    assert_valid(final.outputs[0].text, schema, final.outputs[0].finish_reason)


@pytest.mark.parametrize("constraint,message", [
    (dict(json={"type": "objectx"}), "Invalid type"),
    (dict(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (dict(json={"$ref": "#/$defs/missing"}), "missing"),
    (dict(regex="(ab"), "unclosed group"),
    (dict(grammar="start: undefined_rule"), "undefined_rule"),
])
def test_bad_constraint_is_a_value_error_naming_it(llm, constraint, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("Hi", SamplingParams(max_tokens=4, structured_outputs=constraint))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.runner.num_blocks


@pytest.mark.parametrize("constraint,message", [
    (dict(), "exactly one"),
    (dict(json={"type": "object"}, regex="a"), "exactly one"),
    (dict(choice=[]), "non-empty list"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json=[1, 2]), "JSON schema"),
    (dict(regex=""), "non-empty"),
    (dict(jsn={}), "unknown field"),
    (dict(regex="a", disable_additional_properties="yes"), "must be a boolean"),
])
def test_malformed_structured_outputs_params(constraint, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=constraint)


def test_grammars_are_cached_by_kind_and_spec(llm):
    compiler = llm.engine.grammars
    first = compiler.compile(StructuredOutputsParams(regex="[a-c]{2}"))
    assert compiler.compile(StructuredOutputsParams(regex="[a-c]{2}")) is first
    assert compiler.compile(StructuredOutputsParams(grammar='start: /[a-c]{2}/')) is not first


def test_constraint_sync_rolls_back_and_forward_and_forks_apart(llm):
    """sync keeps a matcher equal to its sequence's output whatever happened between steps."""
    from ember_cupy.structured.bitmask import fill_bitmasks
    compiler, vocab = llm.engine.grammars, llm.engine.model_config.vocab_size
    params = StructuredOutputsParams(json=SCHEMAS["nested_object"])
    tokens = llm.tokenizer.encode('{"user": {"name": "Ann", "age": 3', add_special_tokens=False)

    def mask_after(prefix):
        fresh = compiler.new_constraint(params)
        fresh.sync(prefix)
        return fill_bitmasks([fresh], vocab)

    constraint = compiler.new_constraint(params)
    constraint.sync(tokens)                       # forward: tokens appended without sampling
    assert constraint.consumed == tokens and not constraint.failed
    child = constraint.fork()
    constraint.sync(tokens[:4])                   # back: an output cut to its first 4 tokens
    assert constraint.consumed == tokens[:4]
    assert (fill_bitmasks([constraint], vocab) == mask_after(tokens[:4])).all()
    assert (fill_bitmasks([child], vocab) == mask_after(tokens)).all()   # the fork kept its state
    constraint.sync(tokens[:4] + tokens[4:6])
    assert constraint.consumed == tokens[:6]
    refused = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]   # not after `"age": 3`
    assert not child.accept(refused) and child.failed and child.is_finished
    assert not constraint.failed and not constraint.is_finished


# --- strict JSON schemas -------------------------------------------------------------------------
OPEN_PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with their name, age, city and job."}]


def test_absent_additional_properties_means_no_other_key_unless_opted_out(llm):
    """Strict by default (OpenAI strict mode, vLLM's xgrammar): the model asked for more keys than
    the schema lists writes only those listed; disable_additional_properties=False reads the schema
    as JSON Schema does, and the same greedy run adds the keys it was asked for."""
    def keys(**options):
        params = SamplingParams(temperature=0, max_tokens=64,
                                structured_outputs=StructuredOutputsParams(json=OPEN_PERSON, **options))
        completion = llm.chat(ASK_PERSON, params)[0].outputs[0]
        assert completion.finish_reason == "stop"
        return set(json.loads(completion.text))

    assert keys() == {"name"}
    assert keys(disable_additional_properties=False) > {"name"}


def test_closed_objects_leave_any_object_schemas_and_all_of_branches_open():
    from ember_cupy.structured.closed_objects import close_objects
    schema = {"type": "object", "properties": {
        "point": {"properties": {"x": {"type": "integer"}}},
        "extra": {"type": "object"},
        "mixed": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
        "loose": {"properties": {"c": {}}, "additionalProperties": True}},
        "$defs": {"node": {"properties": {"next": {"$ref": "#/$defs/node"}}}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["point"]["additionalProperties"] is False
    assert closed["$defs"]["node"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["extra"]
    assert all("additionalProperties" not in branch for branch in closed["properties"]["mixed"]["allOf"])
    assert closed["properties"]["loose"]["additionalProperties"] is True
    assert "additionalProperties" not in schema   # the caller's schema is left as it was


# --- what compiled grammars may cost -------------------------------------------------------------
def test_the_grammar_cache_is_bounded_by_the_bytes_its_grammars_hold(llm):
    """(a{1000}){N} is 14 bytes of regex and ~40 MiB of lexer: six distinct ones in a cache of
    100 MiB keep at most 100 MiB, and what is evicted is freed."""
    from ember_cupy.structured.allocated import allocated_bytes
    from ember_cupy.structured.compiler import GrammarCompiler
    budget = 100 << 20
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size, cache_bytes=budget)
    compiler.ll_tokenizer
    start = allocated_bytes()
    for repeat in range(100, 106):
        compiler.compile(StructuredOutputsParams(regex=f"(a{{1000}}){{{repeat}}}"))
        assert compiler.cached_bytes <= budget
    assert 1 <= compiler.num_cached < 6
    assert allocated_bytes() - start < budget + (48 << 20)


def test_a_grammar_over_the_size_limit_is_refused(llm):
    from ember_cupy.structured.compiler import GrammarCompiler
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size, max_grammar_bytes=16 << 20)
    with pytest.raises(ValueError, match="compiles to [0-9]+ MiB; the limit is 16 MiB per constraint"):
        compiler.compile(StructuredOutputsParams(regex="(a{1000}){100}"))
    assert compiler.num_cached == 0


def test_a_complete_grammar_stops_at_its_last_token(llm):
    """Scheduler.update feeds each sampled token to the grammar, so the step that completes it ends
    the sequence ("stop") with nothing after it, even when EOS is ignored."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{4}"))
    completion = llm.generate(chat_prompt(llm, "A year?"), params)[0].outputs[0]
    assert re.fullmatch("[0-9]{4}", completion.text), completion.text
    assert completion.finish_reason == "stop"
    assert llm.tokenizer.decode(completion.token_ids, skip_special_tokens=False) == completion.text
