"""Reply bodies: the documented shape of every reply (tests hold real replies to them)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ember_cupy.server.protocol.base import ResponseModel
from ember_cupy.server.protocol.tools import ToolCall

FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]   # error: the constraint failed
StopReason = str | int | None     # the stop string or stop token id that ended the text (vLLM)


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = Field(description="The field at fault, as a path: messages[0].content.")
    code: str | None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(ResponseModel):
    """OpenAI's legacy shape: one entry per token, top_logprobs mapping token text -> logprob."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(ResponseModel):
    logprob: float
    rank: int | None = Field(description="1 = the likeliest token; null when outside the top k.")
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None] | None
PROMPT_LOGPROBS = Field(None, description="vLLM's prompt_logprobs: per prompt token (null for the first) token id "
                                          "-> logprob; the prompt's own token and the top k.")


TOKEN_IDS = Field(None, description="With return_token_ids (vLLM's): the generated token ids (streamed: the new ones).")
PROMPT_TOKEN_IDS = Field(None, description="With return_token_ids (vLLM's): the prompt's token ids (streamed: in the "
                                           "first chunk).")


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = Field(description="With echo, the prompt's tokens come first (the "
                                                            "first with null logprobs).")
    finish_reason: FinishReason | None
    stop_reason: StopReason = None
    prompt_logprobs: PromptLogprobs = PROMPT_LOGPROBS
    prompt_token_ids: list[int] | None = PROMPT_TOKEN_IDS
    token_ids: list[int] | None = TOKEN_IDS


class Completion(ResponseModel):
    """A /v1/completions reply; with stream=true every chunk has this shape too."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(ResponseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="Null when the reply is only tool calls.")
    tool_calls: list[ToolCall] | None = None


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None
    token_ids: list[int] | None = TOKEN_IDS


class ChatCompletion(ResponseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs = PROMPT_LOGPROBS
    prompt_token_ids: list[int] | None = PROMPT_TOKEN_IDS


class ToolCallFunctionDelta(ResponseModel):
    name: str | None = None
    arguments: str | None = Field(None, description="The next piece of the arguments' JSON text.")


class ToolCallDelta(ResponseModel):
    """A piece of a streamed tool call: the first carries id, type and name, later ones arguments."""
    index: int = Field(description="Which tool call of the message this piece belongs to.")
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunctionDelta | None = None


class ChatDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None
    token_ids: list[int] | None = TOKEN_IDS


class ChatCompletionChunk(ResponseModel):
    """One server-sent event of a streamed chat completion."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs = PROMPT_LOGPROBS
    prompt_token_ids: list[int] | None = PROMPT_TOKEN_IDS


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenPiece(ResponseModel):
    id: int
    piece: str | list[int] = Field(description="The token's text, or its bytes where they are not whole UTF-8.")


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int] | list[TokenPiece] = Field(description="Ids; {id, piece} objects for content with "
                                                              "with_pieces.")
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str
    content: str = Field(description="The same text, as llama-server names it.")


class TokenizerInfoResponse(ResponseModel):
    """GET /tokenizer_info, as vLLM's: what a client needs to tokenize as the server does
    (lm-evaluation-harness's remote tokenizer reads it)."""
    tokenizer_class: str = Field(description="The tokenizer.json format's class in transformers.")
    vocab_size: int
    model_max_length: int
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int] = Field(description="Every token that ends generation.")
    pad_token: str | None
    add_bos_token: bool = Field(description="encode() puts BOS before plain text.")
    chat_template: str | None


class HealthResponse(ResponseModel):
    status: Literal["ready"]

