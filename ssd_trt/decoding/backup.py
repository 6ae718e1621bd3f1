"""Near-zero-latency backup speculator: prompt lookup (n-gram match against the sequence so far).

When the speculation cache misses at large batch, waiting for the neural draft stalls every sequence
(all must hit: p_all = p_hit^b). Prompt lookup proposes the K tokens that followed the most recent
earlier occurrence of the sequence's last n tokens (n = 3, 2, 1), in microseconds. A deterministic
proposal is a point mass q = onehot(x): acceptance min(1, p(x)), residual p without x -- lossless.
"""
from __future__ import annotations

import numpy as np


def ngram_proposal(context: list[int], draft_len: int, max_ngram: int = 3) -> list[int]:
    for size in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-size:]
        for start in range(len(context) - size - 1, -1, -1):
            if context[start:start + size] == tail:
                follow = context[start + size:start + size + draft_len]
                if follow:
                    return (follow + [follow[-1]] * draft_len)[:draft_len]
    return [context[-1]] * draft_len


def point_mass(tokens: list[int], vocab: int) -> np.ndarray:
    probs = np.zeros((len(tokens), vocab))
    probs[np.arange(len(tokens)), tokens] = 1.0
    return probs
