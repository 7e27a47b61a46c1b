"""Incremental detokenization and stop strings.

Text is released only when it is complete UTF-8 (a token may end inside a multi-byte
character: its decode then ends in U+FFFD) and only when it cannot be the start of a stop
string; a stop string is never emitted (unless asked for) even when it spans several tokens.
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""                 # all complete text decoded so far (may pass a stop)
        self.emitted = 0               # how much of self.text has been released
        self._prefix_offset = 0        # tokens before this are fully reflected in self.text
        self._read_offset = 0
        self.stop_matched: str | None = None
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def add_tokens(self, new_token_ids: list[int], check_stop: bool = True) -> str | None:
        """Append tokens. Returns the matched stop string if one is now complete, else None."""
        self.token_ids.extend(new_token_ids)
        return self._decode_new(final=False, check_stop=check_stop)

    def finish(self) -> str:
        """At the end: decode what is left (even a partial character) and release it all."""
        if self.stop_matched is None:
            self._decode_new(final=True)
        return self.release(final=True)

    def _decode_new(self, final: bool, check_stop: bool = True) -> str | None:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        prefix_text = decode(self.token_ids[self._prefix_offset:self._read_offset])
        full_text = decode(self.token_ids[self._prefix_offset:])
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR)):
            return None  # an incomplete character: wait for more tokens
        search_from = max(0, len(self.text) - self._holdback)
        self.text += full_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.stop_matched = self._find_stop(search_from) if check_stop else None
        return self.stop_matched

    def _find_stop(self, search_from: int) -> str | None:
        best = None
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[:at + len(stop) if self.include_stop else at]
        return stop

    def release(self, final: bool = False) -> str:
        """New text that is safe to show: complete, and not possibly a stop's beginning."""
        end = len(self.text) if final or not self.stop else max(self.emitted, len(self.text) - self._holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
