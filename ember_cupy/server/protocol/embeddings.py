"""POST /v1/embeddings: the request body and the response shapes (OpenAI's)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ember_cupy.engine.pooling import POOLING_TYPE
from ember_cupy.server.protocol.base import NULL_IS_ABSENT, Integer, ProtocolModel, ResponseModel
from ember_cupy.server.protocol.requests import MAX_PROMPTS, TRUNCATE_DESCRIPTION, Prompt

POOLING_DESCRIPTION = (f"Pooling: {POOLING_TYPE} token (vLLM's default for decoder-only LMs): the final-normed "
                       "hidden state of each input's last token, L2-normalised (unit length, so a dot product "
                       "is the cosine similarity).")


class EmbeddingRequest(ProtocolModel):
    __doc__ = f"POST /v1/embeddings. {POOLING_DESCRIPTION} {NULL_IS_ABSENT}"

    input: Prompt = Field(description=f"Up to {MAX_PROMPTS} inputs: a string, an array of strings, an array "
                                      "of token ids, or an array of arrays of token ids.",
                          examples=["The food was delicious."])
    model: str | None = Field(None, description="One of the served model names; the loaded model if left out.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: an array of numbers; base64: the little-endian float32 bytes, base64-encoded.")
    dimensions: int | None = Field(None, description="Refused unless it is the model's hidden size: the "
                                                     "embeddings cannot be shortened (no Matryoshka training).")
    truncate_prompt_tokens: Integer | None = Field(None, ge=-1, description=TRUNCATE_DESCRIPTION, examples=[512])
    user: str | None = Field(None, description="Accepted and ignored.")


class EmbeddingData(ResponseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
