"""Prompt-lookup (n-gram) drafting: continue the longest recent suffix that occurred earlier in the text."""

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
