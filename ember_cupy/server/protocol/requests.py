"""Request bodies of every JSON route, the single description of what the server accepts:
requests are validated against these models and /openapi.json is generated from them."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from ember_cupy.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MIN_REPETITION_PENALTY,
)
from ember_cupy.server.protocol.base import (
    METADATA_DESCRIPTION,
    NULL_IS_ABSENT,
    Integer,
    Metadata,
    ProtocolModel,
    integral_float_as_int,
    present,
    check_token_ids,
)
from ember_cupy.server.protocol.messages import MESSAGES_FIELD, Messages
from ember_cupy.server.protocol.tools import ResponseFormat, StructuredOutputs, Tool, ToolChoice

MAX_PROMPTS = 64          # prompts in one batched completions request
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
IGNORED = "Accepted and ignored: it changes nothing on this server."

TokenId = Annotated[int, Field(ge=0), BeforeValidator(integral_float_as_int)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_LENGTH)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
TOKEN_ID_KEY = r"^[0-9]+$"
LogitBias = dict[Annotated[str, StringConstraints(pattern=TOKEN_ID_KEY)], Annotated[float, Field(ge=-100, le=100)]]


def _requires_true(**fields: str) -> dict:
    """JSON Schema's dependentSchemas for "field X only when boolean Y is true"."""
    return {"dependentSchemas": {field: {"required": [flag], "properties": {flag: {"const": True}}}
                                 for field, flag in fields.items()}}


def _stop_as_list(value):
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError("must be a string or an array of strings")
    return value


# names the chat prompt's rendering passes itself (AsyncEngine.off_loop, tool_calls.render_chat,
# Tokenizer.apply_chat_template, ChatTemplate.render): as template variables they would collide
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "tokenize", "tokenizer", "spec", "fn", "work_chars",
                            "bos_token", "eos_token")


def _no_reserved_names(kwargs: dict) -> dict:
    taken = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if taken:
        raise ValueError(f"may not set {', '.join(map(repr, taken))}: the request's own fields say it")
    return kwargs


ChatTemplateKwargs = Annotated[dict[str, Any], AfterValidator(_no_reserved_names)]


class StreamOptions(ProtocolModel):
    include_usage: bool = Field(False, description="End the stream with a chunk carrying the usage.")
    continuous_usage_stats: bool = Field(False, description="Usage so far in every chunk (vLLM).")


TRUNCATE_DESCRIPTION = ("vLLM's: keep only the prompt's last k tokens (-1: as many as the context holds); by "
                        "default a prompt too long for the context is a 400.")


class SamplingFields(ProtocolModel):
    """The fields /v1/completions and /v1/chat/completions share."""
    model: str | None = Field(None, description="A served model name; the first one when left out.",
                              examples=["SmolLM2-135M-Instruct"])
    stream: bool = Field(False, description="Reply as server-sent events, ending with `data: [DONE]`.",
                         examples=[True])
    stream_options: StreamOptions | None = Field(None, description="Only with stream=true.",
                                                 examples=[{"include_usage": True}])
    n: Integer = Field(1, ge=1, le=MAX_N, description="Choices per prompt.")
    best_of: Integer | None = Field(None, ge=1, description="Must equal `n` (default 1): generating more candidates "
                                "than are returned is not supported, any other value is a 400 "
                                "`unsupported_parameter` (as in vLLM's V1 engine).", examples=[1])
    temperature: float = Field(1.0, ge=0, le=100, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: Integer = Field(0, ge=-1, description="0 or -1 = no top-k (vLLM).")
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                      description="vLLM's multiplicative penalty; 1 = none.")
    logit_bias: LogitBias | None = Field(None, description="Token id (as a string) -> bias added to its logit.",
                                         examples=[{"42": -5.0}],
                                         json_schema_extra={"propertyNames": {"pattern": TOKEN_ID_KEY}})
    seed: Integer | None = Field(None, ge=SEED_MIN, le=SEED_MAX, examples=[1234])
    max_tokens: Integer | None = Field(None, ge=1, description="Tokens to generate at most; by default until "
                                                           "the context is full.", examples=[4])
    min_tokens: Integer = Field(0, ge=0, description="Tokens to generate before EOS or a stop may end it.",
                            examples=[1])
    stop: Annotated[StopList, BeforeValidator(_stop_as_list, json_schema_input_type=StopString | StopList)] = Field(
        default_factory=list, description="Strings that end the text (not included in it).", examples=[["\n\n"]])
    stop_token_ids: list[TokenId] = Field(default_factory=list, examples=[[2]])
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, description="vLLM's: sample only among "
                                                    "these token ids (null: all).", examples=[[2, 3, 4]])
    bad_words: list[str] = Field(default_factory=list, description="vLLM's: words never generated (each word's "
                                 "tokens, alone and after a space, never completed).", examples=[["darn"]])
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: Integer | None = Field(None, ge=-1, description=TRUNCATE_DESCRIPTION, examples=[512])
    return_token_ids: bool | None = Field(None, description="vLLM's: the reply carries the prompt's and the "
                                          "generated token ids (streamed: prompt ids in the first chunk, then "
                                          "each chunk's new ids).", examples=[True])
    priority: Integer = Field(0, ge=INT32_MIN, le=INT32_MAX,
                          description="Lower runs first; only with the server's priority policy.", examples=[0])
    cache_salt: str | None = Field(None, min_length=1, description="Prefix-cache isolation key (vLLM).",
                                   examples=["tenant-a"])
    prompt_logprobs: Integer | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                        description="Top-k logprobs of every prompt token (vLLM).", examples=[1])
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's output constraints.")
    speculative: bool = Field(True, description="false: no speculative decoding for this request on a server "
                              "started with --speculative-config (the output is the same either way; only "
                              "its speed and the server's compute per token change).", examples=[False])
    user: str | None = Field(None, description=IGNORED, examples=["user-1"])
    metadata: Metadata | None = Field(None, description=IGNORED + " " + METADATA_DESCRIPTION, examples=[{"k": "v"}])
    store: bool | None = Field(None, description=IGNORED, examples=[False])
    service_tier: str | None = Field(None, description=IGNORED, examples=["auto"])

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_vocab(cls, bias, info: ValidationInfo):
        check_token_ids([int(k) for k in bias], info, "logit_bias token id(s)")
        return bias

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _ids_in_vocab(cls, ids, info: ValidationInfo):
        if ids is not None:
            check_token_ids(ids, info, "token id(s)")
        return ids


def _prompts(value, info: ValidationInfo) -> list:
    """The prompt(s) of a completions request as a list: each a string or a list of token ids."""
    value = _integral_ids(value)
    if isinstance(value, str) or isinstance(value, list) and value and all(_is_int(t) for t in value):
        prompts = [value]
    elif isinstance(value, list) and value and (all(isinstance(p, str) for p in value) or all(
            isinstance(p, list) and all(_is_int(t) for t in p) for p in value)):
        prompts = list(value)
    elif isinstance(value, list) and not value:
        raise ValueError("must not be empty")
    else:
        raise ValueError("must be a string, an array of strings, an array of token ids, "
                         "or an array of arrays of token ids")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"may hold at most {MAX_PROMPTS} prompts, got {len(prompts)}")
    for prompt in prompts:
        if not prompt:
            raise ValueError("must not be empty")
        if isinstance(prompt, list):
            check_token_ids(prompt, info, "prompt token id(s)")
    return prompts


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integral_ids(value):
    """Token ids sent as integral numbers (1.0) as ints, in a list or a list of lists."""
    if not isinstance(value, list):
        return value
    return [_integral_ids(v) if isinstance(v, list) else integral_float_as_int(v) for v in value]


NonEmptyText = Annotated[str, StringConstraints(min_length=1)]
NonEmptyIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = Annotated[list, PlainValidator(_prompts, json_schema_input_type=(
    NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_PROMPTS)] | NonEmptyIds
    | Annotated[list[NonEmptyIds], Field(min_length=1, max_length=MAX_PROMPTS)]))]


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""
    model_config = ConfigDict(json_schema_extra={"description": NULL_IS_ABSENT,
                                                 **_requires_true(stream_options="stream")})

    prompt: Prompt = Field(description=f"A prompt, or up to {MAX_PROMPTS} prompts (n choices each): text or "
                                       "token ids.", examples=["The capital of France is"])
    max_tokens: Integer = Field(16, ge=1, description="Tokens to generate at most.", examples=[4])
    echo: bool = Field(False, description="Put the prompt before the text.", examples=[True])
    logprobs: Integer | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Top-k logprobs per token.",
                                 examples=[1])
    suffix: None = Field(None, description="Not supported (text after an insertion point).")
    response_format: ResponseFormat | None = Field(None, description="As chat's (vLLM and llama-server take it "
                                                   "here too).", examples=[{"type": "text"}])


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""
    model_config = ConfigDict(json_schema_extra={"description": NULL_IS_ABSENT, **_requires_true(
        stream_options="stream", top_logprobs="logprobs")})

    messages: Messages = MESSAGES_FIELD
    max_completion_tokens: Integer | None = Field(None, ge=1, description="OpenAI's new name of max_tokens; wins "
                                                                      "over it.", examples=[4])
    logprobs: bool = Field(False, description="Logprobs of the generated tokens.", examples=[True])
    top_logprobs: Integer | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Only with logprobs=true.",
                                     examples=[2])
    response_format: ResponseFormat | None = Field(None, examples=[{"type": "text"}])
    tools: list[Tool] | None = Field(None, description="Functions the model may call.")
    tool_choice: ToolChoice | None = Field(None, examples=["none"])
    parallel_tool_calls: bool | None = Field(None, description="Several tool calls in one reply.",
                                             examples=[False])
    add_generation_prompt: bool = Field(True, description="End the prompt with the assistant's turn "
                                                          "header (vLLM).")
    chat_template_kwargs: ChatTemplateKwargs | None = Field(None, description="Extra variables for the chat "
                                                                              "template (vLLM).", examples=[{}])
    # fields of OpenAI's chat API with no effect here
    reasoning_effort: str | None = Field(None, description=IGNORED, examples=["low"])
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description=IGNORED)
    prompt_cache_key: str | None = Field(None, description=IGNORED, examples=["key"])
    safety_identifier: str | None = Field(None, description=IGNORED, examples=["user-hash"])
    modalities: list[Literal["text", "audio"]] | None = Field(None, description=IGNORED, examples=[["text"]])
    audio: dict[str, Any] | None = Field(None, description=IGNORED, examples=[{}])
    prediction: dict[str, Any] | None = Field(None, description=IGNORED,
                                              examples=[{"type": "content", "content": "x"}])
    web_search_options: dict[str, Any] | None = Field(None, description=IGNORED, examples=[{}])
    prompt_cache_options: dict[str, Any] | None = Field(None, description=IGNORED + " (prefixes are cached "
                                                        "anyway, see prompt_tokens_details)", examples=[{}])
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(None, description=IGNORED)
    moderation: dict[str, Any] | None = Field(None, description=IGNORED + " No moderation runs here.",
                                              examples=[{"model": "omni-moderation-latest"}])
    functions: None = Field(None, description="OpenAI's deprecated function calling: not supported; use tools.")
    function_call: None = Field(None, description="Not supported; use tool_choice.")


class TokenizeRequest(ProtocolModel):
    """POST /tokenize: exactly one of prompt and messages (vLLM's forms) and content (llama-server's)."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [present("prompt"), present("messages"),
                                                           present("content")]})

    model: str | None = None
    prompt: str | None = Field(None, examples=["Hello"])
    content: str | None = Field(None, description="llama-server's form: its text; the reply's tokens are ids, or "
                                "{id, piece} objects with with_pieces.", examples=["Hello"])
    add_special: bool = Field(False, description="With content: add BOS etc.")
    parse_special: Literal[True] = Field(True, description="With content: only true (special tokens' text is "
                                         "read as the special tokens).")
    with_pieces: bool = Field(False, description="With content: each token as {id, piece}; piece is its text, "
                              "or its bytes where they are not whole UTF-8.")
    messages: Messages | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="Add BOS etc.; by default yes for a prompt, no for "
                                                              "messages (their template writes them).")
    add_generation_prompt: bool = True
    return_token_strs: bool = Field(False, examples=[True])
    # with messages, as chat renders them: the same prompt tokens as the chat request would count
    tools: list[Tool] | None = Field(None, description="With messages: the chat request's tools.")
    tool_choice: ToolChoice | None = Field(None, examples=["none"])
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = Field(None, examples=[{}])


class DetokenizeRequest(ProtocolModel):
    """POST /detokenize."""
    model: str | None = None
    tokens: list[TokenId] = Field(examples=[[1, 2, 3]])

    @field_validator("tokens")
    @classmethod
    def _in_vocab(cls, ids, info: ValidationInfo):
        check_token_ids(ids, info, "token id(s)")
        return ids
