"""Incremental detokenization with stop strings, for streaming text out token by token."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Decodes only a short window (from ``prefix_offset``) each step, so a step costs the same
    whatever the output length, and holds back text that may still change: an incomplete UTF-8
    character (the tokenizer gives U+FFFD) or a tail that could begin a stop string.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""  # everything decoded so far (never more than up to a stop string)
        self.sent = 0  # characters of ``text`` already handed out
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def update(self, output_ids: list[int], finished: bool) -> tuple[str, bool]:
        """Add the newest token(s); return ``(text delta, hit a stop string)``."""
        prefix = self._decode(output_ids[self.prefix_offset : self.read_offset])
        window = self._decode(output_ids[self.prefix_offset :])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self.text += window[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        stopped = False
        if self.stop:
            longest = max(len(s) for s in self.stop)
            search_from = max(0, self.sent - longest)
            hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                stopped = True
        end = len(self.text)
        if not (finished or stopped):
            end -= self._pending_stop_prefix()
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta, stopped

    def _pending_stop_prefix(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:size]):
                    best = size
                    break
        return best
