"""How strategies feed an engine (``engines/base.py``'s contract): ragged rows, and tree masks.

* :func:`feed_rows`: a different number of tokens per row in one step (right-padded, then rolled back),
  with the logits of each row's last few tokens only.
* :func:`tree_mask_from_parents`: the bool [N, N] visibility of a token tree (ancestor-or-self).
"""
from __future__ import annotations

import numpy as np


def feed_rows(engine, rows: list[list[int]], tail: int = 1) -> np.ndarray:
    """Append a different number of tokens to each row; return the logits of each row's last ``tail``
    tokens [B, tail, V] (every row must get at least ``tail`` tokens; only those pay the LM head).

    Rows are right-padded to one length and then rolled back: the causal mask keeps padding unseen by
    real tokens, and the rollback drops its cache slots.
    """
    batch = len(rows)
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    ids = np.zeros((batch, int(lengths.max())), dtype=np.int64)
    for row, tokens in enumerate(rows):
        ids[row, :len(tokens)] = tokens
    start = engine.lengths
    wanted = lengths[:, None] - tail + np.arange(tail)[None, :]           # ragged: per-row positions
    logits = engine.forward(ids, start[:, None] + np.arange(ids.shape[1])[None, :], logit_indices=wanted)
    engine.rollback(start + lengths.astype(np.int32))
    return logits


def feed_ragged(engine, rows: list[list[int]]) -> np.ndarray:
    """:func:`feed_rows`, returning each row's last-position logits [B, V]."""
    return feed_rows(engine, rows, tail=1)[:, 0]


def tree_mask_from_parents(parents: list[int]) -> np.ndarray:
    """Boolean [N, N]: node i sees node j iff j is i or an ancestor of i."""
    size = len(parents)
    mask = np.eye(size, dtype=bool)
    for node in range(size):
        ancestor = parents[node]
        while ancestor >= 0:
            mask[node, ancestor] = True
            ancestor = parents[ancestor]
    return mask
