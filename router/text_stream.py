"""Token ids -> text deltas for streaming, with OpenAI `stop` strings.

Text is re-decoded from all ids each time (a byte-level or BPE token may complete a character only with
the next token), a trailing U+FFFD of an incomplete character is held back, and so is any suffix that could
still become a stop string; a stop string ends the text before it.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridserve.models.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer | None, stops: Sequence[str] = ()) -> None:
        if stops and tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        self._tokenizer = tokenizer
        self._stops = list(stops)
        self.token_ids: list[int] = []
        self.text = ""  # emitted so far
        self.stopped = False  # a stop string matched: the request should end

    def add(self, token_ids: Sequence[int]) -> str:
        """The text delta these tokens release (may be empty while a stop string could still match)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        if self._tokenizer is None:
            return ""
        visible = self._tokenizer.decode(self.token_ids)
        while visible.endswith("\ufffd"):
            visible = visible[:-1]
        end = len(visible)
        cut = self._first_stop(visible)
        if cut is not None:
            self.stopped, end = True, cut
        else:
            end -= self._holdback(visible)
        end = max(end, len(self.text))
        delta = visible[len(self.text) : end]
        self.text += delta
        return delta

    def finish(self) -> str:
        """Release text held back for a stop string that never came."""
        if self.stopped or self._tokenizer is None:
            return ""
        visible = self._tokenizer.decode(self.token_ids)
        delta = visible[len(self.text) :]
        self.text += delta
        return delta

    def _first_stop(self, visible: str) -> int | None:
        start = max(0, len(self.text) - max((len(s) for s in self._stops), default=0))
        found = [i for i in (visible.find(s, start) for s in self._stops) if i >= 0]
        return min(found) if found else None

    def _holdback(self, visible: str) -> int:
        """Length of the longest suffix of `visible` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(visible)), best, -1):
                if visible.endswith(stop[:k]):
                    best = k
                    break
        return best
