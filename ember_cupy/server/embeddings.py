"""POST /v1/embeddings: each input becomes an embedding request of the shared engine (a
prefill-only request whose last hidden state is pooled, ember_cupy/engine/pooling.py), batched
in the same steps as the generation requests."""
from __future__ import annotations

import asyncio
import base64
import uuid

import numpy as np
from aiohttp import web

from ember_cupy.engine.pooling import PoolingParams
from ember_cupy.server.async_engine import EngineDeadError, EngineNotReadyError
from ember_cupy.server.request_stream import RequestStream
from ember_cupy.server.errors import APIError, from_value_error
from ember_cupy.server.protocol import validate
from ember_cupy.server.protocol.embeddings import EmbeddingRequest
from ember_cupy.server.serving import OpenAIServing, engine_error
from ember_cupy.server.validation import read_json_body


class EmbeddingsServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.engine = serving.engine

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await read_json_body(request)
        serving = self.serving
        serving.ensure_ready()
        req = validate(EmbeddingRequest, body, self.engine.tokenizer.vocab_size)
        serving.check_model(req.model)
        self.check_dimensions(req.dimensions)
        try:
            params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens)
        except ValueError as exc:
            raise from_value_error(exc, param="truncate_prompt_tokens") from None
        finals = await self.pooled(req.input, params)
        num_tokens = sum(len(final.prompt_token_ids) for final in finals)
        return web.json_response({
            "object": "list", "model": req.model or serving.model_names[0],
            "data": [{"object": "embedding", "index": index, "embedding": _encode(final.embedding, req.encoding_format)}
                     for index, final in enumerate(finals)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    async def pooled(self, inputs: list, params: PoolingParams) -> list:
        """Each input's final output, its embedding computed (a 400 naming `input` if one is refused)."""
        token_ids = await self.serving.tokenize_prompts(inputs, "input", add_special_tokens=True, params=params)
        streams = await self._admit(inputs, token_ids, params)
        try:
            finals = await asyncio.gather(*[stream.final() for stream in streams])
        except (EngineDeadError, EngineNotReadyError) as exc:
            raise engine_error(exc) from None
        finally:
            for stream in streams:
                stream.close()
        if any(final.embedding is None for final in finals):   # aborted (the server is stopping)
            raise APIError(503, "the request was aborted before its embeddings were computed",
                           code="engine_not_ready")
        return finals

    def check_dimensions(self, dimensions: int | None) -> None:
        size = self.engine.model_info().hidden_size
        if dimensions is not None and dimensions != size:
            raise APIError(400, f"'dimensions' {dimensions} is not supported: this model's embeddings have "
                                f"{size} dimensions and cannot be shortened", param="dimensions",
                           code="unsupported_parameter")

    async def _admit(self, inputs: list, token_ids: list[list[int]], params: PoolingParams) -> list[RequestStream]:
        """One engine request per input; on any refusal none is left running."""
        response_id = f"embd-{uuid.uuid4().hex}"
        results = await asyncio.gather(*[
            self.engine.add_request(item, params, request_id=f"{response_id}-{i}",
                                    prompt_token_ids=ids if isinstance(item, str) else None, prompt_index=i)
            for i, (item, ids) in enumerate(zip(inputs, token_ids, strict=True))], return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [(i, r) for i, r in enumerate(results) if not isinstance(r, RequestStream)]
        if not errors:
            return streams
        for stream in streams:
            stream.close()
        index, error = errors[0]
        if isinstance(error, asyncio.CancelledError):
            raise error
        if not isinstance(error, ValueError):
            raise engine_error(error)
        api_error = from_value_error(error, param="input")
        if len(inputs) > 1:
            api_error.message = f"input[{index}]: {api_error.message}"
        raise api_error


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":   # what the openai SDK asks for by default, and decodes
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding
