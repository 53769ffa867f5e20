"""Token ids -> text deltas for streaming, with OpenAI `stop` strings.

The ids are detokenized incrementally (`models.detokenizer`: each token costs a decode of a few tokens, not
of the whole output, which made a long generation quadratic). What is released is the text decoded so far
minus the U+FFFD of a character whose bytes have not all arrived, minus any suffix that could still become a
stop string; a stop string ends the text before it (or after it, with `include_stop`). Only the last
`max(len(stop))` released characters are needed to find a stop that straddles two deltas, so that tail is all
that is searched besides the new text.

The engine runs one per request with stop strings, fed one token at a time, to finish the request on the
worker (a stop inside a run of accepted speculative tokens cuts the rest); the router runs one per choice for
the text it streams.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridserve.common.detokenizer import IncrementalDetokenizer
from hybridserve.common.tokenizer import Tokenizer


class TextStream:
    """One generation's text, released delta by delta (`add`), with the rest at the end (`finish`)."""

    def __init__(self, tokenizer: Tokenizer | None, stops: Sequence[str] = (), include_stop: bool = False) -> None:
        if stops and tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stops = list(stops)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop
        self.token_ids: list[int] = []
        self._pieces: list[str] = []  # released so far, joined on demand by `text`
        self._tail = ""  # the last `_max_stop` released characters: where a stop may have begun
        self._confirmed = ""  # decoded text not yet released (held back for a stop string, or just decoded)
        self._skip = 0  # leading characters of `_confirmed + tentative` released already (tentative text)
        self.stopped = False  # a stop string matched: the request should end

    @property
    def text(self) -> str:
        """All text released so far."""
        return "".join(self._pieces)

    def add(self, token_ids: Sequence[int]) -> str:
        """The text delta these tokens release (may be empty while a stop string could still match)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        if self._detok is None:
            return ""
        confirmed, tentative = self._detok.push(token_ids)
        self._confirmed += confirmed
        unreleased = (self._confirmed + tentative)[self._skip:]
        if not self._stops:
            return self._release(unreleased)
        window = self._tail + unreleased
        found = self._first_stop(window)
        if found is not None:
            cut, stop = found
            self.stopped, end = True, cut + (len(stop) if self._include_stop else 0)
        else:
            end = len(window) - self._holdback(window)
        return self._release(unreleased[:max(end - len(self._tail), 0)])

    def finish(self) -> str:
        """Release text held back for a stop string that never came."""
        if self.stopped or self._detok is None:
            return ""
        self._confirmed += self._detok.flush()
        return self._release(self._confirmed[self._skip:])

    def _release(self, delta: str) -> str:
        """Record `delta` (a prefix of the unreleased text) as released and return it."""
        if delta:
            self._pieces.append(delta)
            if self._max_stop:
                self._tail = (self._tail + delta)[-self._max_stop:]
        self._skip += len(delta)
        dropped = min(self._skip, len(self._confirmed))
        self._confirmed, self._skip = self._confirmed[dropped:], self._skip - dropped
        return delta

    def _first_stop(self, window: str) -> tuple[int, str] | None:
        """Where the earliest stop string in `window` starts, and which (the longest of those starting there)."""
        found = [(i, -len(s), s) for i, s in ((window.find(s), s) for s in self._stops) if i >= 0]
        if not found:
            return None
        index, _, stop = min(found)
        return index, stop

    def _holdback(self, window: str) -> int:
        """Length of the longest suffix of `window` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(window)), best, -1):
                if window.endswith(stop[:k]):
                    best = k
                    break
        return best
