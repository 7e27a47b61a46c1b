"""The responses kept for `previous_response_id`: in memory, bounded in count, age and bytes.

Each response is kept as its JSON encoding, the body sent and the conversation it ends: what is
counted against the byte bound is exactly what is held (metadata, instructions, tools, text.format
and the output included), not a Python object graph several times its size."""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_RESPONSES = 1000            # the least recently used go first
TTL_SECONDS = 3600.0            # a response older than this is forgotten
MAX_BYTES = 64 << 20            # JSON bytes kept, all responses together


def _encoded(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(frozen=True)
class StoredResponse:
    body_json: bytes            # the response as it was sent
    messages_json: bytes        # the conversation it ends, as chat messages (without instructions)
    stored_at: float

    @property
    def size(self) -> int:
        """Bytes counted against max_bytes."""
        return len(self.body_json) + len(self.messages_json)

    @property
    def messages(self) -> list[dict]:
        return json.loads(self.messages_json)


class ResponseStore:
    """An LRU of responses with a time to live and a budget of bytes. Lost on restart."""

    def __init__(self, max_responses: int = MAX_RESPONSES, ttl_seconds: float = TTL_SECONDS,
                 max_bytes: int = MAX_BYTES, clock=time.monotonic):
        self.max_responses = max_responses
        self.ttl_seconds = ttl_seconds
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, body: dict, messages: list[dict]) -> None:
        entry = StoredResponse(_encoded(body), _encoded(messages), self._clock())
        if entry.size > self.max_bytes:
            return   # could never be kept
        self._drop(body["id"])
        self._entries[body["id"]] = entry
        self._bytes += entry.size
        while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if self._clock() - entry.stored_at > self.ttl_seconds:
            self._drop(response_id)
            return None
        self._entries.move_to_end(response_id)
        return entry

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
