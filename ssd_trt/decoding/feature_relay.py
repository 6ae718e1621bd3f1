"""Handing the target's features of verified tokens to a feature draft (``engines/feature_draft.py``).

The target computes features for every token it is fed; only those of tokens it verified are handed over
(the prompt after the prefill; t*_prev and the accepted s_1..s_k after a verification; the accepted path of
a tree), each with the position of its first token. In the engine step each request keeps them in its
:class:`FeatureLog` (a request may run rounds without the draft, or join the draft's rows late), and
:func:`relay_features` hands each draft row what it lacks whenever the draft is idle.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class FeatureLog:
    """The target's features of one request's verified tokens, positions 0 .. count-1 (they arrive in order),
    and how many of them its draft row holds (``relayed``: 0 for a new draft row)."""

    def __init__(self) -> None:
        self._features: np.ndarray | None = None
        self.count = 0
        self.relayed = 0

    def append(self, first: int, features: np.ndarray) -> None:
        if first != self.count:
            raise ValueError(f"target features must continue the verified prefix at position {self.count}, got "
                             f"position {first}")
        needed = self.count + len(features)
        if self._features is None:
            self._features = np.zeros((0, features.shape[1]), dtype=np.float32)
        if needed > len(self._features):       # grow geometrically: a request appends a few rows per round
            grown = np.zeros((max(needed, 2 * len(self._features)), self._features.shape[1]), dtype=np.float32)
            grown[:self.count] = self._features[:self.count]
            self._features = grown
        self._features[self.count:needed] = features
        self.count = needed

    def since(self, first: int) -> np.ndarray:
        return self._features[first:self.count].copy()


def relay_features(draft, seqs: Sequence) -> None:
    """Hand draft row i (``seqs[i]``'s) the features its row does not have yet (a no-op for an independent
    draft). Call only while the draft is idle."""
    if not draft.takes_target_features:
        return
    for row, seq in enumerate(seqs):
        log = seq.features
        if log is not None and log.relayed < log.count:
            draft.receive_target_features(row, log.relayed, log.since(log.relayed))
            log.relayed = log.count


def target_features(target) -> np.ndarray:
    """The features [B, T, F] of every token of the target's last step."""
    features = target.last_features
    if not target.has_features or features is None:
        raise RuntimeError(f"{target.spec.name}: the draft reads the target's features but the target engine "
                           "returned none (a build for a feature draft exports the target with them)")
    return features
