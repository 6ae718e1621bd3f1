"""Prompt lookup: what followed earlier occurrences of the sequence's last n tokens. The one n-gram matcher
of the draft's copy component, SSD's backup speculator and its lookup forks.

Three users:

* the draft's copy component (``engines/copy_mixture.py``, :func:`longest_match`): the token that followed the
  most recent earlier occurrence of the longest recurring suffix;
* the near-zero-latency backup speculator (:func:`ngram_proposal`): when the speculation cache misses at
  large batch, waiting for the neural draft stalls every sequence (all must hit: p_all = p_hit^b), so the K
  tokens that followed the most recent earlier occurrence of the last n tokens (n = 3, 2, 1) are proposed, in
  microseconds. A deterministic proposal is a point mass q = onehot(x) (``TokenDistribution.point_mass``):
  acceptance min(1, p(x)), residual p without x -- lossless;
* extra bonus-token guesses for the speculation cache (:func:`lookup_followers`): text that quotes,
  summarises or edits its context repeats spans the small draft does not rank highly, and the token that
  followed the same n-gram earlier catches them.

All three read :func:`suffix_occurrences`, which grows the match one token at a time over the surviving
candidates only: a few vector compares on a shrinking set instead of one full scan per n-gram size.
"""
from __future__ import annotations

import numpy as np


def suffix_occurrences(context: np.ndarray, max_ngram: int) -> list[np.ndarray]:
    """``levels[n - 1]``: the end positions e (ascending) of the earlier occurrences of the last n tokens,
    context[e - n + 1 : e + 1], that are followed by a token (e + 1 < len(context)); one level per n from 1 up
    to the longest n <= ``max_ngram`` that occurs (empty when even the last token is new)."""
    if len(context) < 2 or max_ngram < 1:
        return []
    ends = np.flatnonzero(context[:-1] == context[-1])
    levels = []
    while len(ends):
        levels.append(ends)
        size = len(levels)
        if size == max_ngram:
            break
        longer = ends[ends >= size]
        ends = longer[context[longer - size] == context[-1 - size]]
    return levels


def earlier_matches(context: np.ndarray, size: int) -> np.ndarray:
    """Start indices s (most recent first) with context[s:s+size] == the last ``size`` tokens and
    s + size < len(context), i.e. occurrences that are followed by at least one token."""
    levels = suffix_occurrences(context, size)
    if len(levels) < size:
        return np.zeros(0, dtype=np.int64)
    return (levels[size - 1] - (size - 1))[::-1]


def longest_match(context: np.ndarray, max_ngram: int) -> tuple[int, int] | None:
    """(follower, n) for the most recent earlier occurrence of the longest suffix of ``context``
    (n <= ``max_ngram`` tokens) that is followed by a token; None when even the last token is new."""
    levels = suffix_occurrences(context, max_ngram)
    if not levels:
        return None
    return int(context[levels[-1][-1] + 1]), len(levels)


def lookup_followers(context: list[int], max_ngram: int = 4, limit: int = 3) -> list[tuple[int, int]]:
    """Up to ``limit`` distinct tokens that followed an earlier occurrence of the context's suffix, as
    (token, n) with n the length of the matched suffix: longest match first, then most recent."""
    array = np.asarray(context, dtype=np.int64)
    found: list[tuple[int, int]] = []
    levels = suffix_occurrences(array, max_ngram)
    for size in range(len(levels), 0, -1):
        for end in levels[size - 1][::-1]:
            token = int(array[end + 1])
            if all(token != seen for seen, _ in found):
                found.append((token, size))
                if len(found) == limit:
                    return found
    return found


def ngram_proposal(context: list[int], draft_len: int, max_ngram: int = 3) -> list[int]:
    """The ``draft_len`` tokens that followed the most recent earlier occurrence of the longest suffix (the
    last one repeated where the context ends first); the last token repeated when nothing recurs."""
    levels = suffix_occurrences(np.asarray(context, dtype=np.int64), max_ngram)
    if not levels:
        return [context[-1]] * draft_len
    start = int(levels[-1][-1]) + 1
    follow = context[start:start + draft_len]
    return (follow + [follow[-1]] * draft_len)[:draft_len]
