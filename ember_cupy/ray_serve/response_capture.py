"""The payload writer of an aiohttp response answered without a connection (in_process_app.py):
the status and headers once, then the body chunks, handed to whoever sends them on."""
from __future__ import annotations

import asyncio

from aiohttp.abc import AbstractStreamWriter
from aiohttp.compression_utils import ZLibCompressor
from multidict import CIMultiDict

HIGH_WATER = 2 ** 16   # bytes not yet taken before write() waits, as a socket's send buffer makes it


class _End:
    def __init__(self, error: BaseException | None):
        self.error = error


class ResponseCapture(AbstractStreamWriter):
    """head(): (status, headers) once the app wrote them; chunks(): the body as written; close(task),
    the handler task's done callback, ends both (with the task's error, if it failed)."""

    def __init__(self):
        self._head: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._queued = 0
        self._room = asyncio.Event()
        self._room.set()
        self._compressor: ZLibCompressor | None = None
        self.length = None

    async def head(self) -> tuple[int, CIMultiDict]:
        return await self._head

    async def chunks(self):
        while True:
            item = await self._queue.get()
            if isinstance(item, _End):
                if item.error is not None:   # failed mid-body: the ASGI server drops the connection
                    raise item.error
                return
            self._queued -= len(item)
            if self._queued <= HIGH_WATER:
                self._room.set()
            yield item

    def close(self, task: asyncio.Task) -> None:
        error = (ConnectionAbortedError("the response was cancelled") if task.cancelled() else task.exception()
                 or (None if self._head.done() else RuntimeError("the app ended without a response")))
        if not self._head.done():
            self._head.set_exception(error)
        self._queue.put_nowait(_End(error))

    async def write_headers(self, status_line: str, headers: CIMultiDict) -> None:
        self.output_size += len(status_line) + sum(len(k) + len(v) + 4 for k, v in headers.items()) + 4
        if not self._head.done():   # else the caller left before the head
            self._head.set_result((int(status_line.split(" ", 2)[1]), CIMultiDict(headers)))

    async def write(self, chunk) -> None:
        data = bytes(chunk)
        if self._compressor is not None:
            data = await self._compressor.compress(data)
        await self._put(data)

    async def write_eof(self, chunk: bytes = b"") -> None:
        if chunk:
            await self.write(chunk)
        if self._compressor is not None:
            await self._put(self._compressor.flush())

    async def drain(self) -> None:
        await self._room.wait()

    def enable_compression(self, encoding: str = "deflate", strategy: int | None = None) -> None:
        self._compressor = ZLibCompressor(encoding=encoding, strategy=strategy)

    def enable_chunking(self) -> None:
        """Nothing to do: the framing is the ASGI server's (Serve's proxy)."""

    async def _put(self, data: bytes) -> None:
        if not data:
            return
        self.output_size += len(data)
        self._queued += len(data)
        self._queue.put_nowait(data)
        if self._queued > HIGH_WATER:
            self._room.clear()
            await self._room.wait()
