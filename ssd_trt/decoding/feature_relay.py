"""Handing the target's features of verified tokens to a feature draft (``engines/feature_draft.py``).

The target computes features for every token it is fed; only those of tokens it verified are handed over
(the prompt after the prefill; t*_prev and the accepted s_1..s_k after a verification; the accepted path of
a tree), each with the position of its first token. In the engine step each request keeps them in its
:class:`FeatureLog` until :func:`relay_features` hands them to its draft row, whenever the draft is idle (after
the prefill, after each verification: the draft may be busy speculating for other rows when they arrive).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class FeatureLog:
    """The target's features of one request's verified tokens, positions 0 .. count-1 (they arrive in order),
    and how many of them its draft row holds (``relayed``). Only those not yet relayed are kept: the draft
    engine holds the rest (``FeatureDraftEngine``), and a request's draft row lives from its first round to its
    end (the engine step drops it only when the draft fails, and then the request runs on without the draft)."""

    def __init__(self) -> None:
        self._features: np.ndarray | None = None      # positions relayed .. count-1
        self.count = 0
        self.relayed = 0

    def append(self, first: int, features: np.ndarray) -> None:
        if first != self.count:
            raise ValueError(f"target features must continue the verified prefix at position {self.count}, got "
                             f"position {first}")
        kept = self._features if self._features is not None else np.zeros((0, features.shape[1]), np.float32)
        self._features = np.concatenate([kept, np.asarray(features, dtype=np.float32)])
        self.count += len(features)

    def take(self) -> tuple[int, np.ndarray]:
        """The features the draft row lacks (from position ``relayed`` on), now relayed."""
        first, features = self.relayed, self._features
        self._features, self.relayed = None, self.count
        return first, features


def relay_features(draft, seqs: Sequence) -> None:
    """Hand draft row i (``seqs[i]``'s) the features its row does not have yet (a no-op for an independent
    draft). Call only while the draft is idle."""
    if not draft.takes_target_features:
        return
    for row, seq in enumerate(seqs):
        log = seq.features
        if log is not None and log.relayed < log.count:
            draft.receive_target_features(row, *log.take())


def target_features(target) -> np.ndarray:
    """The features [B, T, F] of every token of the target's last step."""
    features = target.last_features
    if not target.has_features or features is None:
        raise RuntimeError(f"{target.spec.name}: the draft reads the target's features but the target engine "
                           "returned none (a build for a feature draft exports the target with them)")
    return features
