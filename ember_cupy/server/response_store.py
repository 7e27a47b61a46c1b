"""The responses kept for `previous_response_id`: in memory, bounded in count, age and size."""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_RESPONSES = 1000            # the least recently used go first
TTL_SECONDS = 3600.0            # a response older than this is forgotten
MAX_CHARS = 64 << 20            # conversation text kept, all responses together


@dataclass(frozen=True)
class StoredResponse:
    body: dict                  # the response as it was sent
    messages: list[dict]        # the conversation it ends, as chat messages (without instructions)
    size: int                   # characters, counted against MAX_CHARS
    stored_at: float


class ResponseStore:
    """An LRU of responses with a time to live and a budget of characters. Lost on restart."""

    def __init__(self, max_responses: int = MAX_RESPONSES, ttl_seconds: float = TTL_SECONDS,
                 max_chars: int = MAX_CHARS, clock=time.monotonic):
        self.max_responses = max_responses
        self.ttl_seconds = ttl_seconds
        self.max_chars = max_chars
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, body: dict, messages: list[dict]) -> None:
        size = len(json.dumps(messages, ensure_ascii=False))
        if size > self.max_chars:
            return   # could never be kept
        self._drop(body["id"])
        self._entries[body["id"]] = StoredResponse(body, messages, size, self._clock())
        self._chars += size
        while len(self._entries) > self.max_responses or self._chars > self.max_chars:
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
            self._chars -= entry.size
