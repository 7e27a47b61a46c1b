"""RequestStream: what a caller of AsyncEngine.add_request reads, one request's delta outputs.

Streams carry deltas (OutputKind.DELTA): each step adds only its new text, tokens and logprobs,
and a reader that falls behind finds them merged into one output, so what a request buffers is
at most what its reader has not read yet (the engine loop aborts a request whose reader leaves an
output unread too long: unread_for).
"""
from __future__ import annotations

import asyncio
import time

from ember_cupy.outputs import DeltaAccumulator, RequestOutput


class RequestStream:
    """The delta outputs of one request, in order; those its reader has not taken yet are
    merged into one. Iterate it (or await final()); close() aborts it if unfinished (through
    `engine.abort(request_id)`, the engine that owns it)."""

    def __init__(self, request_id: str, engine):
        self.request_id = request_id
        self._engine = engine
        self._backlog = DeltaAccumulator()
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._unread_since: float | None = None   # when the oldest unread output came
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        else:
            if not self._backlog:
                self._unread_since = time.monotonic()
            self._backlog.add(item)
        self._ready.set()

    def _drop_backlog(self) -> None:
        self._backlog = DeltaAccumulator()
        self._unread_since = None

    def unread_for(self, now: float) -> float:
        """Seconds the oldest unread output has waited for the reader (0 when none waits)."""
        return 0.0 if self._unread_since is None else now - self._unread_since

    @property
    def backlog_size(self) -> tuple[int, int]:
        """(characters, token ids) received and not read yet."""
        return self._backlog.num_chars, self._backlog.num_token_ids

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._backlog and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        output = self._backlog.take()
        self._unread_since = None
        if output is None:
            self.finished = True
            raise self._error
        self.finished = output.finished
        return output

    async def final(self) -> RequestOutput:
        """The whole answer: every delta merged, once the request has finished."""
        whole = DeltaAccumulator()
        async for output in self:
            whole.add(output)
        return whole.take()

    def close(self) -> None:
        """Abort the request unless it already finished (a disconnected client, a cancel)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)
