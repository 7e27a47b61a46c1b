"""RemoteEngine: the engine the ingress's HTTP app talks to, forwarding to engine replicas.

The ingress runs the project's own server (ember_cupy.server.build_app: parsing, errors, chat
templates, tool calls, SSE, response shapes); this object stands where an AsyncEngine stands there:
add_request() admits a request on a replica (chosen by the deployment's request router) and gives
back a stream of its delta outputs; closing the stream cancels the Ray streaming call, which
aborts the request on its replica. Tokenizing and chat templates run here, with the model's own
tokenizer, exactly as in `ember-cupy serve`: on threads of their own for small and for large texts,
for at most prepare_timeout seconds (then PrepareTimeoutError: a 408). A prompt's token ids and its
index among its request's prompts go to the replica with it (not tokenized again there; its
scheduler serves every request's first prompt before any request's second).
"""
from __future__ import annotations

import asyncio
import logging

from ray.exceptions import RayError

from ember_cupy.engine_client import ModelInfo
from ember_cupy.outputs import RequestOutput
from ember_cupy.ray_serve.replica import ADMISSION_ERRORS, ADMITTED, REFUSED
from ember_cupy.ray_serve.routing_key import RoutingKeys
from ember_cupy.sampling_params import SamplingParams
from ember_cupy.server.async_engine import SMALL_TEXT_CHARS, EngineDeadError, EngineState
from ember_cupy.server.prepare_workers import DEFAULT_PREPARE_TIMEOUT, PrepareWorkers
from ember_cupy.server.request_stream import RequestStream

log = logging.getLogger("ember_cupy.ray_serve")


class RemoteStream(RequestStream):
    """A request's delta outputs, read from its replica's streaming generator: a RequestStream
    (iterate it, final(), close()) whose backlog is Ray's stream, not a local accumulator."""

    def __init__(self, request_id: str, responses, live: set):
        super().__init__(request_id, engine=None)
        self._responses = responses
        self._live = live          # the engine's unfinished streams, this one among them
        self.finished = False
        live.add(self)

    def _finish(self) -> None:
        self.finished = True
        self._live.discard(self)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            _, output = await self._responses.__anext__()
        except StopAsyncIteration:
            self._finish()
            raise
        except RayError as exc:   # the replica died or was lost mid-request
            self._finish()
            raise EngineDeadError(f"the engine replica serving {self.request_id} failed: "
                                  f"{type(exc).__name__}") from exc
        if output.finished:
            self._finish()
        return output

    def close(self) -> None:
        """Cancel the call unless it finished: the replica's generator is cancelled and aborts."""
        if not self.finished:
            self._finish()
            self._responses.cancel()


class RemoteEngine:
    """AsyncEngine's interface as the HTTP app uses it, over a handle to the engine deployment."""

    metrics = None   # each replica keeps its own; the ingress serves them all (fleet_metrics.py)

    def __init__(self, handle, model: str | None, admission_retries: int = 1,
                 prepare_timeout: float = DEFAULT_PREPARE_TIMEOUT):
        if not prepare_timeout > 0:
            raise ValueError(f"prepare_timeout must be > 0 seconds, got {prepare_timeout}")
        self.handle = handle
        self.model = model
        self.admission_retries = admission_retries   # on a replica that died before admitting
        self.prepare_timeout = prepare_timeout
        self.state = EngineState.NEW
        self.error: str | None = None
        self.tokenizer = None
        self.max_model_len = None
        self._model_info: ModelInfo | None = None
        self.keys: RoutingKeys | None = None
        self._streams: set[RemoteStream] = set()
        self._small_text = PrepareWorkers("ember-text", slow=False)
        self._large_text = PrepareWorkers("ember-large-text", slow=True)

    async def start(self) -> None:
        """Learn the replicas' engine shape; load the model's tokenizer alone (the ingress never
        computes, so it reads no weights)."""
        self.state = EngineState.LOADING
        try:
            info = await self.handle.info.remote()
            self.tokenizer = await asyncio.to_thread(_load_tokenizer, self.model)
        except Exception as exc:
            self.state, self.error = EngineState.DEAD, f"starting the ingress failed: {exc}"
            raise
        self._model_info = info["model_info"]
        self.max_model_len = self._model_info.max_model_len
        self.keys = RoutingKeys(self._model_info.block_size)
        self.state = EngineState.READY

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        self.state = EngineState.STOPPED
        for stream in list(self._streams):
            stream.close()
        for workers in (self._small_text, self._large_text):
            workers.shutdown()

    @property
    def is_ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def model_info(self) -> ModelInfo:
        """The replicas' model (they serve one), as the first replica asked at start described it."""
        return self._model_info

    async def off_loop(self, fn, *args, work_chars: int = 0, **kwargs):
        """As AsyncEngine.off_loop (no max_waiting here: each replica sheds its own load)."""
        workers = self._large_text if work_chars > SMALL_TEXT_CHARS else self._small_text
        return await workers.run(lambda _abandoned: fn(*args, **kwargs), self.prepare_timeout)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.off_loop(self.tokenizer.encode, text, add_special_tokens=add_special_tokens,
                                   work_chars=len(text))

    async def add_request(self, prompt, params: SamplingParams | None = None, *, request_id: str,
                          priority: int = 0, cache_salt: str | None = None,
                          prompt_token_ids: list[int] | None = None, prompt_index: int = 0,
                          add_special_tokens: bool = True) -> RemoteStream:
        """Admit on a replica; raises what AsyncEngine.add_request raises (ValueError, overloaded,
        timed out, not ready, dead), so the HTTP layer answers exactly as `ember-cupy serve` does.
        A string prompt is tokenized here once (for the routing key) and its ids travel with it."""
        if isinstance(prompt, str) and prompt_token_ids is None:
            prompt_token_ids = await self.tokenize(prompt, add_special_tokens)
        ids = prompt_token_ids if isinstance(prompt, str) else prompt
        routing_key = await self.off_loop(self.keys.of, ids, cache_salt)
        params = params or SamplingParams()
        for attempt in range(self.admission_retries + 1):
            responses = self.handle.options(stream=True).generate.remote(
                prompt, params, request_id=request_id, priority=priority, cache_salt=cache_salt,
                prompt_token_ids=prompt_token_ids, prompt_index=prompt_index, routing_key=routing_key)
            try:
                kind, detail = await responses.__anext__()
            except asyncio.CancelledError:
                responses.cancel()
                raise
            except RayError as exc:   # nothing generated yet: safe to try another replica
                if attempt == self.admission_retries:
                    raise EngineDeadError(f"no engine replica could admit the request: "
                                          f"{type(exc).__name__}") from exc
                log.warning("replica failed before admitting %s (%s); retrying", request_id,
                            type(exc).__name__)
                continue
            if kind == REFUSED:
                name, message = detail
                raise ADMISSION_ERRORS[name](message)
            assert kind == ADMITTED, kind
            return RemoteStream(request_id, responses, self._streams)


def _load_tokenizer(model: str | None):
    from ember_cupy.model.loader import load_tokenizer
    return load_tokenizer(model)
