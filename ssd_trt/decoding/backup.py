"""Prompt lookup: what followed earlier occurrences of the sequence's last n tokens.

Two users. (1) The near-zero-latency backup speculator: when the speculation cache misses at large
batch, waiting for the neural draft stalls every sequence (all must hit: p_all = p_hit^b), so prompt
lookup proposes the K tokens that followed the most recent earlier occurrence of the last n tokens
(n = 3, 2, 1), in microseconds. A deterministic proposal is a point mass q = onehot(x)
(``TokenDistribution.point_mass``): acceptance min(1, p(x)), residual p without x -- lossless.
(2) Extra bonus-token guesses for the speculation cache (``lookup_followers``): text that quotes,
summarises or edits its context repeats spans the small draft does not rank highly, and the token that
followed the same n-gram earlier catches them.
"""
from __future__ import annotations

import numpy as np


def earlier_matches(context: np.ndarray, size: int) -> np.ndarray:
    """Start indices s (most recent first) with context[s:s+size] == the last ``size`` tokens and
    s + size < len(context), i.e. occurrences that are followed by at least one token."""
    if size < 1 or len(context) <= size:
        return np.zeros(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(context[:-1], size)   # windows ending before the last token
    starts = np.flatnonzero((windows == context[-size:]).all(axis=1))
    return starts[::-1]


def lookup_followers(context: list[int], max_ngram: int = 4, limit: int = 3) -> list[tuple[int, int]]:
    """Up to ``limit`` distinct tokens that followed an earlier occurrence of the context's suffix, as
    (token, n) with n the length of the matched suffix: longest match first, then most recent."""
    array = np.asarray(context, dtype=np.int64)
    found: list[tuple[int, int]] = []
    for size in range(min(max_ngram, len(array) - 1), 0, -1):
        for start in earlier_matches(array, size):
            token = int(array[start + size])
            if all(token != seen for seen, _ in found):
                found.append((token, size))
                if len(found) == limit:
                    return found
    return found


def ngram_proposal(context: list[int], draft_len: int, max_ngram: int = 3) -> list[int]:
    array = np.asarray(context, dtype=np.int64)
    for size in range(min(max_ngram, len(array) - 1), 0, -1):
        starts = earlier_matches(array, size)
        if len(starts):
            follow = context[starts[0] + size:starts[0] + size + draft_len]
            return (follow + [follow[-1]] * draft_len)[:draft_len]
    return [context[-1]] * draft_len
