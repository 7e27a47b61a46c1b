"""llama.cpp's native server API (llama-server's /completion, /apply-template, /props and the
`content` form of /tokenize): the request bodies and the reply shapes, as llama.cpp's clients send
and read them. Only the shapes: server/llamacpp_requests.py maps a request onto the completion path.

Defaults are llama-server's (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, repeat_penalty 1.0,
n_predict -1). Samplers this engine does not implement (Mirostat, DRY, XTC, typical, dynamic
temperature, top-n-sigma) are accepted at their "off" values only: any other value is a 400 naming
the field, never a silently different sampler. Unlike llama-server, an unknown field is a 400 too.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    PlainValidator,
    RootModel,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ember_cupy.sampling_params import MAX_LOGPROBS, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from ember_cupy.server.protocol.base import Integer, ProtocolModel, ResponseModel, check_token_ids
from ember_cupy.server.protocol.messages import MESSAGES_FIELD, Messages
from ember_cupy.server.protocol.requests import IGNORED, MAX_PROMPTS, SEED_MAX, SEED_MIN, StopList, TokenId

# the samplers llama-server's `samplers` names; the order here is the one applied (see SAMPLERS_NOTE)
SAMPLER_NAMES = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature",
                 "infill")
SAMPLERS_NOTE = ("The samplers to use. One left out is off (e.g. no top_k); the order is always penalties, "
                 "top_k, top_p, min_p, temperature.")
OFF_ONLY = "Only the value that turns it off: the sampler is not implemented here."
RANDOM_SEEDS = (-1, 0xFFFFFFFF)   # llama-server's "pick a random seed"
NOT_IMPLEMENTED = "the sampler is not implemented here"
OFF_VALUES = {"mirostat": 0, "typical_p": 1.0, "dynatemp_range": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
              "top_n_sigma": -1.0, "n_indent": 0, "n_cmpl": 1, "t_max_predict_ms": 0, "post_sampling_probs": False,
              "return_progress": False, "lora": []}
OFF_WHY = {**dict.fromkeys(["mirostat", "typical_p", "dynatemp_range", "dry_multiplier", "xtc_probability",
                            "top_n_sigma"], NOT_IMPLEMENTED),
           "n_indent": "indentation rules are not implemented", "n_cmpl": "send a request per completion",
           "t_max_predict_ms": "bound the text with n_predict", "post_sampling_probs":
           "n_probs gives the probabilities before the sampling chain", "return_progress": "no progress events",
           "lora": "no LoRA adapters are loaded"}

def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()


def _one_prompt(value, info: ValidationInfo) -> list:
    """One prompt as its pieces: text and token ids, in order."""
    if isinstance(value, dict):
        if set(value) - {"prompt_string", "multimodal_data"} or not isinstance(value.get("prompt_string"), str):
            raise ValueError("a prompt object holds 'prompt_string' (text) and nothing else")
        if value.get("multimodal_data"):
            raise ValueError("multimodal_data needs a multimodal model; this server serves text only")
        value = value["prompt_string"]
    pieces = [value] if isinstance(value, str) else value
    if not isinstance(pieces, list) or not all(isinstance(p, str) or _is_id(p) for p in pieces):
        raise ValueError("a prompt is a string, an array of token ids and strings, or {\"prompt_string\": ...}")
    pieces = [p if isinstance(p, str) else int(p) for p in pieces]
    check_token_ids([p for p in pieces if not isinstance(p, str)], info, "prompt token id(s)")
    if not any(pieces):
        raise ValueError("must not be empty")
    return pieces


def _prompts(value, info: ValidationInfo) -> list[list]:
    """llama-server's reading: an array holding any token id is one prompt of mixed pieces; any
    other array is several prompts (one result each)."""
    if isinstance(value, list) and value and not any(_is_id(p) for p in value):
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"may hold at most {MAX_PROMPTS} prompts, got {len(value)}")
        return [_one_prompt(p, info) for p in value]
    return [_one_prompt(value, info)]


_Text = Annotated[str, StringConstraints(min_length=1)]
_Pieces = Annotated[list[TokenId | _Text], Field(min_length=1)]
LlamaPrompt = Annotated[list, PlainValidator(_prompts, json_schema_input_type=(
    _Text | _Pieces | Annotated[list[_Text | _Pieces], Field(min_length=1, max_length=MAX_PROMPTS)]))]


def _bias_pairs(value, info: ValidationInfo) -> list[tuple[int | str, float | None]]:
    """[(token id or text, bias)], bias None for false (never that token)."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise ValueError("must be [[token id or text, bias or false], ...] or {\"token id or text\": bias or false}")
    out = []
    for key, bias in pairs:
        if isinstance(key, str) and key.isdigit() and isinstance(value, dict):
            key = int(key)   # OpenAI's form: {"15043": 1.0}
        if not (isinstance(key, str) and key or _is_id(key)):
            raise ValueError(f"{key!r} is neither a token id nor a text")
        if bias is not False and (isinstance(bias, bool) or not isinstance(bias, (int, float))
                                  or not math.isfinite(bias)):
            raise ValueError(f"the bias of {key!r} must be a finite number or false")
        out.append((key if isinstance(key, str) else int(key), None if bias is False else float(bias)))
    check_token_ids([k for k, _ in out if isinstance(k, int)], info, "logit_bias token id(s)")
    return out


LogitBiasPairs = Annotated[list, PlainValidator(_bias_pairs, json_schema_input_type=(
    list[tuple[int | str, float | bool]] | dict[str, float | bool]))]


class LlamaCppCompletionRequest(ProtocolModel):
    """POST /completion (and /completions): llama-server's native completion."""
    model_config = ConfigDict(json_schema_extra={"not": {"required": ["grammar", "json_schema"]}})

    prompt: LlamaPrompt = Field(description="A string, token ids and strings mixed ([12, 34, \"text\"]), or an "
                                "array of such prompts (one result each; not with stream).",
                                examples=["Building a website can be done in 10 simple steps:"])
    model: str | None = Field(None, description="A served model name; the first one when left out.")
    stream: bool = Field(False, description="Server-sent events, one per delta; the last has stop=true "
                                            "(no [DONE]).")
    n_predict: Integer = Field(-1, ge=-2, description="Tokens to generate at most; -1 (or -2): until the end "
                               "of the context or a stop; 0: none (nothing is computed).", examples=[16])
    temperature: float = Field(0.8, le=100, description="<= 0: greedy.")
    top_k: Integer = Field(40, description="<= 0: no top-k.")
    top_p: float = Field(0.95, ge=0, le=1, description="1: off.")
    min_p: float = Field(0.05, ge=0, le=1, description="0: off.")
    stop: StopList = Field(default_factory=list, description="Strings that end the text (not included in it).",
                           examples=[["\n\n"]])
    seed: Integer = Field(-1, ge=SEED_MIN, le=SEED_MAX, description="-1 (or 4294967295): a random seed.",
                          examples=[42])
    repeat_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                  description="vLLM's repetition_penalty: over the prompt and the output.")
    repeat_last_n: Integer = Field(64, ge=-1, description="0: no penalties; any other value: they cover the "
                                   "whole sequence (llama-server's -1).")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    ignore_eos: bool = False
    logit_bias: LogitBiasPairs | None = Field(None, description="Token id or text -> bias added to its logits "
                                              "(text: each of its tokens); false: never that token.",
                                              examples=[[[15043, 1.0]]])
    n_probs: Integer = Field(0, ge=0, le=MAX_LOGPROBS, description="Top logprobs per generated token "
                             "(completion_probabilities).")
    grammar: str | None = Field(None, description="A GBNF (or Lark) grammar the text follows.",
                                examples=['root ::= "yes" | "no"'])
    json_schema: dict[str, Any] | None = Field(None, description="A JSON Schema the text follows.",
                                               examples=[{"type": "object"}])
    samplers: list[Literal[SAMPLER_NAMES]] | None = Field(None, description=SAMPLERS_NOTE,
                                                          examples=[["top_k", "temperature"]])
    return_tokens: bool = Field(False, description="Fill `tokens` with the generated ids (a stream always does).")
    timings_per_token: bool = Field(False, description="Timings in every streamed event.")
    response_fields: list[str] | None = Field(None, description="Only these fields of the result; a/b lifts "
                                              "field b of object a to the top as \"a/b\".",
                                              examples=[["content", "generation_settings/n_predict"]])
    cache_prompt: bool = Field(True, description="Accepted and ignored: prompt prefixes are always cached.")
    id_slot: Integer = Field(-1, description=IGNORED + " (no slots: every request may run beside the others)")
    n_keep: Integer = Field(0, description=IGNORED + " A prompt longer than the context is refused, never shifted.")
    n_discard: Integer = Field(0, description=IGNORED)
    n_cache_reuse: Integer = Field(0, description=IGNORED)
    min_keep: Integer = Field(0, ge=0, description=IGNORED + " (a sampler always keeps one token)")
    sse_ping_interval: float | None = Field(None, description=IGNORED)
    dynatemp_exponent: float = Field(1.0, description=IGNORED + " (dynamic temperature only)")
    mirostat_tau: float = Field(5.0, description=IGNORED + " (Mirostat only)")
    mirostat_eta: float = Field(0.1, description=IGNORED + " (Mirostat only)")
    dry_base: float = Field(1.75, description=IGNORED + " (DRY only)")
    dry_allowed_length: Integer = Field(2, description=IGNORED + " (DRY only)")
    dry_penalty_last_n: Integer = Field(-1, description=IGNORED + " (DRY only)")
    dry_sequence_breakers: list[str] | None = Field(None, description=IGNORED + " (DRY only)")
    xtc_threshold: float = Field(0.1, description=IGNORED + " (XTC only)")
    tfs_z: float = Field(1.0, description=IGNORED + " (removed from llama.cpp)")
    penalize_nl: bool = Field(False, description=IGNORED + " (removed from llama.cpp)")
    # implemented only off: any other value is a 400 saying so
    mirostat: Integer = Field(0, description=OFF_ONLY + " (0)", examples=[0])
    typical_p: float = Field(1.0, description=OFF_ONLY + " (1.0)", examples=[1.0])
    dynatemp_range: float = Field(0.0, description=OFF_ONLY + " (0.0)", examples=[0.0])
    dry_multiplier: float = Field(0.0, description=OFF_ONLY + " (0.0)", examples=[0.0])
    xtc_probability: float = Field(0.0, description=OFF_ONLY + " (0.0)", examples=[0.0])
    top_n_sigma: float = Field(-1.0, description=OFF_ONLY + " (<= 0)", examples=[-1.0])
    n_indent: Integer = Field(0, description=OFF_ONLY + " (0)", examples=[0])
    n_cmpl: Integer = Field(1, description="Only 1: send a request per completion.", examples=[1])
    t_max_predict_ms: Integer = Field(0, description=OFF_ONLY + " (0; bound the text with n_predict)",
                                      examples=[0])
    post_sampling_probs: bool = Field(False, description="Only false: n_probs gives the probabilities before "
                                      "the sampling chain.", examples=[False])
    return_progress: bool = Field(False, description="Only false.", examples=[False])
    lora: list[Any] | None = Field(None, description="Only empty: no LoRA adapters are loaded.", examples=[[]])

    @field_validator(*OFF_VALUES)
    @classmethod
    def _off(cls, value, info: ValidationInfo):
        off = OFF_VALUES[info.field_name]
        if value != off and not (info.field_name == "top_n_sigma" and value <= 0):
            raise ValueError(f"{value!r} is not supported: only {off!r} ({OFF_WHY[info.field_name]})")
        return value

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("give either 'grammar' or 'json_schema', not both")
        return self


class ApplyTemplateRequest(ProtocolModel):
    """POST /apply-template: the chat template applied, nothing generated."""
    messages: Messages = MESSAGES_FIELD
    model: str | None = None


class ApplyTemplateResponse(ResponseModel):
    prompt: str


class LlamaCppTokenProbability(ResponseModel):
    id: int
    token: str
    bytes: list[int]
    logprob: float


class LlamaCppProbabilities(LlamaCppTokenProbability):
    top_logprobs: list[LlamaCppTokenProbability]


class LlamaCppTimings(ResponseModel):
    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class LlamaCppCompletion(ResponseModel):
    """A /completion result, or one streamed event (an event has the fields up to tokens_evaluated,
    and completion_probabilities / timings when asked, until the last, stop=true, which has them
    all). response_fields keeps only the fields it names (and adds "a/b" ones): so none is required."""
    model_config = ConfigDict(extra="allow")

    index: int | None = None
    content: str | None = None
    tokens: list[int] | None = None
    id_slot: int | None = None
    stop: bool | None = None
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    model: str | None = None
    generation_settings: dict[str, Any] | None = None
    prompt: str | None = None
    has_new_line: bool | None = None
    truncated: bool | None = None
    stop_type: Literal["none", "eos", "limit", "word"] | None = None
    stopping_word: str | None = None
    tokens_cached: int | None = None
    timings: LlamaCppTimings | None = None
    completion_probabilities: list[LlamaCppProbabilities] | None = None


class LlamaCppResults(RootModel[LlamaCppCompletion | list[LlamaCppCompletion]]):
    """/completion's reply: a result, or one per prompt when the request has several."""


class LlamaCppProps(ResponseModel):
    """GET /props: the server's settings, as llama-server's."""
    default_generation_settings: dict[str, Any]
    total_slots: int = Field(description="Sequences run at once (--max-num-seqs).")
    model_alias: str
    model_path: str
    chat_template: str
    chat_template_caps: dict[str, bool]
    bos_token: str
    eos_token: str
    modalities: dict[str, bool]
    build_info: str
    is_sleeping: bool
