"""Ollama's native API (/api/chat, /api/generate, /api/embed, /api/embeddings, /api/show): the
request bodies and the reply shapes, as Ollama's clients send and read them. Only the shapes:
server/ollama_requests.py maps a request onto the chat or completion path."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ember_cupy.sampling_params import MAX_LOGPROBS, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from ember_cupy.server.protocol.base import (
    NULL_IS_ABSENT,
    Integer,
    ProtocolModel,
    ResponseModel,
    check_token_ids,
    one_of,
)
from ember_cupy.server.protocol.requests import IGNORED, MAX_PROMPTS, SEED_MAX, SEED_MIN, StopList, TokenId
from ember_cupy.server.protocol.tools import Tool

SERVER_WIDE = "Accepted and ignored: a setting of the whole server here (its command-line flags)."
KEEP_ALIVE = Field(None, description="0 (\"0s\"...) on a request that asks nothing unloads the model of a "
                   "--models-dir server, as `ollama stop`; otherwise ignored: the model stays loaded.",
                   examples=["5m"])


class OllamaOptions(ProtocolModel):
    """Ollama's model options: the sampling ones apply to the request; the load-time ones are the
    server's flags here. An unknown option is an error naming it."""
    # sampling
    num_predict: Integer | None = Field(None, description="Tokens to generate at most; <= 0 (Ollama's -1 and "
                                        "-2): until the end of the context or a stop.", examples=[64])
    temperature: float | None = Field(None, ge=0, le=100, description="0 = greedy.", examples=[0.7])
    top_k: Integer | None = Field(None, description="<= 0: no top-k.", examples=[40])
    top_p: float | None = Field(None, gt=0, le=1, examples=[0.9])
    min_p: float | None = Field(None, ge=0, le=1, examples=[0.05])
    seed: Integer | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="-1: a random seed.",
                                 examples=[42])
    stop: StopList | None = Field(None, description="Strings that end the text (not included in it).",
                                  examples=[["\n\n"]])
    repeat_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                         description="vLLM's repetition_penalty: over the prompt and the output "
                                                     "(repeat_last_n 0 turns it off).", examples=[1.1])
    repeat_last_n: Integer | None = Field(None, ge=-1, description="0: no repeat penalty; any other value: the "
                                          "penalty covers the whole sequence (Ollama's -1).", examples=[-1])
    presence_penalty: float | None = Field(None, ge=-2, le=2, examples=[0.5])
    frequency_penalty: float | None = Field(None, ge=-2, le=2, examples=[0.5])
    typical_p: float | None = Field(None, description="Only 1.0 (off): locally typical sampling is not "
                                    "implemented.", examples=[1.0])
    mirostat: Integer | None = Field(None, description="Only 0 (off): Mirostat is not implemented.", examples=[0])
    mirostat_tau: float | None = Field(None, description=IGNORED + " (Mirostat only)", examples=[5.0])
    mirostat_eta: float | None = Field(None, description=IGNORED + " (Mirostat only)", examples=[0.1])
    tfs_z: float | None = Field(None, description=IGNORED + " (removed from Ollama)", examples=[1.0])
    penalize_newline: bool | None = Field(None, description=IGNORED + " (removed from Ollama)", examples=[True])
    num_keep: Integer | None = Field(None, description=IGNORED + " A prompt longer than the context is refused, "
                                     "never shifted.", examples=[4])
    num_ctx: Integer | None = Field(None, description="Accepted and ignored: the context is the server's "
                                    "--max-model-len, and prompts are never cut silently.", examples=[4096])
    # load time: the server's flags
    numa: bool | None = Field(None, description=SERVER_WIDE)
    num_batch: Integer | None = Field(None, description=SERVER_WIDE)
    num_gpu: Integer | None = Field(None, description=SERVER_WIDE)
    main_gpu: Integer | None = Field(None, description=SERVER_WIDE)
    low_vram: bool | None = Field(None, description=SERVER_WIDE)
    f16_kv: bool | None = Field(None, description=SERVER_WIDE)
    logits_all: bool | None = Field(None, description=SERVER_WIDE)
    vocab_only: bool | None = Field(None, description=SERVER_WIDE)
    use_mmap: bool | None = Field(None, description=SERVER_WIDE)
    use_mlock: bool | None = Field(None, description=SERVER_WIDE)
    embedding_only: bool | None = Field(None, description=SERVER_WIDE)
    num_thread: Integer | None = Field(None, description=SERVER_WIDE)

    @model_validator(mode="after")
    def _only_what_is_implemented(self):
        if self.typical_p is not None and self.typical_p != 1.0:
            raise ValueError("typical_p other than 1.0 is not supported (locally typical sampling is not "
                             "implemented); use top_p, top_k or min_p")
        if self.mirostat not in (None, 0):
            raise ValueError("mirostat is not supported (only 0, off); use top_p, top_k or min_p")
        return self


Format = one_of('"json", "" or a JSON Schema object', Literal["", "json"], dict[str, Any])
Think = one_of('true, false, "low", "medium" or "high"', bool, Literal["low", "medium", "high"])


class _Generation(ProtocolModel):
    model: str = Field(min_length=1, description="A served model name (\":latest\" may follow it).",
                       examples=["SmolLM2-135M-Instruct"])
    stream: bool = Field(True, description="true (Ollama's default): newline-delimited JSON objects, the last "
                                           "with done=true; false: one object.", examples=[False])
    format: Format | None = Field(None, description='"json": the reply is a JSON value; a JSON Schema: the reply '
                                  "follows it.", examples=["json"])
    options: OllamaOptions | None = None
    think: Think | None = Field(None, description="With a --reasoning-parser server: true (or a level) returns "
                                "the thinking apart, false asks the model not to think. Without one, only false.",
                                examples=[False])
    logprobs: bool | None = Field(None, description="Each chunk's tokens with their logprobs.", examples=[True])
    top_logprobs: Integer | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token "
                                         "(with logprobs).", examples=[2])
    keep_alive: float | str | None = KEEP_ALIVE


class OllamaToolCallFunction(ProtocolModel):
    name: str = Field(examples=["get_weather"])
    arguments: dict[str, Any] = Field(examples=[{"city": "Paris"}])
    index: Integer | None = Field(None, description=IGNORED)


class OllamaToolCall(ProtocolModel):
    id: str | None = Field(None, examples=["call_0"])
    type: Literal["function"] | None = None
    function: OllamaToolCallFunction


class OllamaMessage(ProtocolModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"role": "user", "content": "Hello!"}]})
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field("", examples=["Hello!"])
    thinking: str | None = Field(None, description="An earlier reply's thinking: left out of the prompt.")
    images: list[str] | None = Field(None, max_length=0, description="Not supported (the served model reads "
                                     "text only): only an empty list.")
    tool_calls: list[OllamaToolCall] | None = Field(None, description="An assistant's earlier calls.")
    tool_name: str | None = Field(None, description="A tool message: the tool that answered.",
                                  examples=["get_weather"])
    tool_call_id: str | None = Field(None, description="A tool message: the id of the call it answers.")

    @model_validator(mode="after")
    def _fields_fit_the_role(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("'tool_calls' are allowed only in assistant messages")
        if (self.tool_name is not None or self.tool_call_id is not None) and self.role != "tool":
            raise ValueError("'tool_name' and 'tool_call_id' are allowed only in tool messages")
        return self


class OllamaChatRequest(_Generation):
    """POST /api/chat. """ + NULL_IS_ABSENT
    messages: list[OllamaMessage] = Field(default_factory=list, description="The conversation so far, oldest "
                                          "first; none: the model is loaded and nothing generated.")
    tools: list[Tool] | None = Field(None, description="Functions the model may call.")


class OllamaGenerateRequest(_Generation):
    """POST /api/generate. """ + NULL_IS_ABSENT
    prompt: str = Field("", description="Empty: the model is loaded and nothing generated.",
                        examples=["Why is the sky blue?"])
    system: str | None = Field(None, description="A system message before the prompt (not with raw).",
                               examples=["Be brief."])
    raw: bool = Field(False, description="true: the prompt goes to the model as it is, without the chat "
                                         "template.", examples=[True])
    context: list[TokenId] | None = Field(None, description="The `context` of an earlier reply: its token ids, "
                                          "put before this prompt's.", examples=[[1, 2, 3]])
    suffix: None = Field(None, description="Not supported (fill-in-the-middle).")
    template: None = Field(None, description="Not supported: the model's own chat template is used.")
    images: list[str] | None = Field(None, max_length=0, description="Not supported: only an empty list.")

    @field_validator("context")
    @classmethod
    def _in_the_vocabulary(cls, ids: list[int], info: ValidationInfo) -> list[int]:
        check_token_ids(ids, info, "'context' token ids")
        return ids


EmbedInput = one_of(f"a string or an array of at most {MAX_PROMPTS} strings", str,
                    list[str])


class OllamaEmbedRequest(ProtocolModel):
    """POST /api/embed. """ + NULL_IS_ABSENT
    model: str = Field(min_length=1, examples=["SmolLM2-135M-Instruct"])
    input: EmbedInput = Field(examples=["Why is the sky blue?"])
    truncate: bool = Field(True, description="true: an input longer than the context keeps its first tokens; "
                                             "false: it is an error.", examples=[False])
    dimensions: Integer | None = Field(None, ge=1, description="Only the model's own size.")
    options: OllamaOptions | None = Field(None, description=IGNORED)
    keep_alive: float | str | None = KEEP_ALIVE

    @model_validator(mode="after")
    def _bounded(self):
        if isinstance(self.input, list) and not 1 <= len(self.input) <= MAX_PROMPTS:
            raise ValueError(f"'input' holds 1 to {MAX_PROMPTS} strings, got {len(self.input)}")
        return self


class OllamaEmbeddingsRequest(ProtocolModel):
    """POST /api/embeddings (Ollama's older embedding route). """ + NULL_IS_ABSENT
    model: str = Field(min_length=1, examples=["SmolLM2-135M-Instruct"])
    prompt: str = Field(examples=["Why is the sky blue?"])
    options: OllamaOptions | None = Field(None, description=IGNORED)
    keep_alive: float | str | None = KEEP_ALIVE


class _NamesAModel(ProtocolModel):
    model: str | None = Field(None, examples=["SmolLM2-135M-Instruct"])
    name: str | None = Field(None, description="Ollama's older name of `model`.")

    @model_validator(mode="after")
    def _names_a_model(self):
        if (self.model or self.name) is None:
            raise ValueError("'model' is required")
        return self


class OllamaShowRequest(_NamesAModel):
    """POST /api/show. """ + NULL_IS_ABSENT
    verbose: bool | None = Field(None, description=IGNORED)


class OllamaPullRequest(_NamesAModel):
    """POST /api/pull: succeeds for a served model (nothing is downloaded). """ + NULL_IS_ABSENT
    insecure: bool | None = Field(None, description=IGNORED)
    stream: bool = Field(True, description="true: the status as newline-delimited JSON.")


class OllamaStatus(ResponseModel):
    status: Literal["success"]


# --- replies -------------------------------------------------------------------------------------
class OllamaDetails(ResponseModel):
    parent_model: str
    format: Literal["gguf", "safetensors"]
    family: str = Field(description="The model's architecture (llama, qwen2, gemma3, ...).")
    families: list[str]
    parameter_size: str = Field(examples=["135M"])
    quantization_level: str = Field(description="A GGUF file's type (Q4_K_M, Q8_0, ...); a checkpoint's dtype.",
                                    examples=["Q4_K_M"])


class OllamaModelEntry(ResponseModel):
    name: str = Field(examples=["SmolLM2-135M-Instruct:latest"])
    model: str
    modified_at: str = Field(description="The model file's modification time (RFC 3339).")
    size: int = Field(description="The model's bytes on disk.")
    digest: str = Field(description="Identifies the served file (its path, size and modification time), as "
                                    "Ollama's digest names its manifest.")
    details: OllamaDetails


class OllamaTags(ResponseModel):
    """GET /api/tags: the served models."""
    models: list[OllamaModelEntry]


class OllamaRunningModel(ResponseModel):
    name: str = Field(examples=["SmolLM2-135M-Instruct:latest"])
    model: str
    size: int = Field(description="The served weights' bytes in memory.")
    digest: str
    details: OllamaDetails
    expires_at: str = Field(description="Never: a served model stays loaded (a date far ahead, as Ollama's "
                                        "keep_alive -1 shows).")
    size_vram: int = Field(description="Of `size`, the bytes in GPU memory: 0 on the CPU backend.")
    context_length: int


class OllamaProcesses(ResponseModel):
    """GET /api/ps: the loaded models."""
    models: list[OllamaRunningModel]


class OllamaShowResponse(ResponseModel):
    modelfile: str
    parameters: str
    template: str = Field(description="The model's chat template (Jinja, not Ollama's Go template).")
    details: OllamaDetails
    model_info: dict[str, Any] = Field(description="general.architecture, general.parameter_count and "
                                                   "<architecture>.context_length / embedding_length.")
    capabilities: list[str] = Field(examples=[["completion", "tools"]])
    modified_at: str


class OllamaToolCallOut(ResponseModel):
    id: str
    function: dict[str, Any] = Field(description="{index, name, arguments (an object)}")


class OllamaMessageOut(ResponseModel):
    role: Literal["assistant"]
    content: str
    thinking: str | None = None
    tool_calls: list[OllamaToolCallOut] | None = None


class OllamaLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]] | None = None


class _Chunk(ResponseModel):
    model: str
    created_at: str = Field(description="RFC 3339, UTC.")
    done: bool
    done_reason: Literal["stop", "length", "load", "abort"] | None = Field(
        None, description="The last object's: stop (end of text, a stop string or a tool call), length, load "
                          "(nothing asked), abort (the server is stopping).")
    total_duration: int | None = Field(None, description="Nanoseconds, with the stats below in the last object.")
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[OllamaLogprob] | None = None


class OllamaChatChunk(_Chunk):
    """A /api/chat reply (stream=false), or each line of its stream."""
    message: OllamaMessageOut


class OllamaGenerateChunk(_Chunk):
    """A /api/generate reply (stream=false), or each line of its stream."""
    response: str
    thinking: str | None = None
    context: list[int] | None = Field(None, description="The last object's: the prompt's and the reply's token "
                                                        "ids (send back as `context` to continue).")


class OllamaEmbedResponse(ResponseModel):
    model: str
    embeddings: list[list[float]] = Field(description="L2-normalised, one per input.")
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbeddingsResponse(ResponseModel):
    embedding: list[float]


class OllamaVersion(ResponseModel):
    version: str = Field(description="The Ollama release whose API these routes follow.")


class OllamaError(ResponseModel):
    """Every error of the /api/ routes, in Ollama's shape (also a streamed line after a failure)."""
    error: str
