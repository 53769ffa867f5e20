"""Prompt-lookup (n-gram) drafting: continue the longest recent suffix that occurred earlier in the text.

`NgramIndex` keeps, per n, the latest start of every n-gram that is followed by a token, and is updated as
tokens arrive, so a proposal costs O(max_n) lookups instead of a scan over the whole context (a 32K-token
request would otherwise rescan 32K positions every step). `propose_ngram` is the plain scan, kept as the oracle.
"""

from __future__ import annotations


def propose_ngram(tokens: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_drafts` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of length max_n..min_n; [] when no suffix recurs."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # latest occurrence that ends before the suffix itself starts
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + num_drafts]
                if follow:
                    return follow
    return []


class NgramIndex:
    """Latest start of each n-gram (min_n <= n <= max_n) that some token follows, for one growing sequence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._covered = 0  # sequence length the index has seen

    def _sync(self, tokens: list[int]) -> None:
        for length in range(self._covered + 1, len(tokens) + 1):
            for n, latest in self._latest.items():
                start = length - 1 - n  # the n-gram that the token at length - 1 now follows
                if start >= 0:
                    latest[tuple(tokens[start : start + n])] = start
        self._covered = len(tokens)

    def propose(self, tokens: list[int], num_drafts: int) -> list[int]:
        """Same proposals as `propose_ngram(tokens, num_drafts, min_n, max_n)`; `tokens` only ever grows."""
        self._sync(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._latest[n].get(tuple(tokens[length - n :]))
            if start is not None:
                return tokens[start + n : start + n + num_drafts]
        return []
