"""Handing the target's features of verified tokens to a feature draft (``engines/feature_draft.py``).

The target computes features for every token it is fed; only those of tokens it verified are handed over
(the prompt after the prefill; t*_prev and the accepted s_1..s_k after a verification; the accepted path of
a tree), each with the position of its first token. With an independent draft every function here is a
no-op, so the strategies call them unconditionally.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

# row -> (first position, features [n, F]) of the tokens just verified (rows with nothing new are absent)
Verified = dict[int, tuple[int, np.ndarray]]


def prompt_features(target, draft, prompts: list[list[int]]) -> Verified:
    """After the target's prefill: every prompt token's features (the step right-padded ragged rows)."""
    if not draft.takes_target_features:
        return {}
    features = _features_of(target)
    return {row: (0, features[row, :len(prompt)].copy()) for row, prompt in enumerate(prompts)}


def chain_features(target, draft, outcomes: Sequence) -> Verified:
    """After ``rounds.verify_and_commit``: the features of t*_prev, s_1..s_k (the target's cache ends there)."""
    if not draft.takes_target_features:
        return {}
    features, lengths = _features_of(target), target.lengths
    return {row: (int(lengths[row]) - outcome.accepted - 1, features[row, :outcome.accepted + 1].copy())
            for row, outcome in enumerate(outcomes) if outcome is not None}


def tree_features(target, draft, row: int, start: int, path: list[int]) -> Verified:
    """After a tree verification of ``row`` (before ``keep``): the features of the accepted path's nodes."""
    if not draft.takes_target_features:
        return {}
    return {row: (start, _features_of(target)[row, path].copy())}


def hand_over(draft, verified: Verified) -> None:
    """Give the draft what the target verified (on the draft's own thread in SSD)."""
    for row, (first, features) in verified.items():
        draft.receive_target_features(row, first, features)


def _features_of(target) -> np.ndarray:
    features = target.last_features
    if not target.has_features or features is None:
        raise RuntimeError(f"{target.spec.name}: the draft reads the target's features but the target engine "
                           "returned none (a build for a feature draft exports the target with them)")
    return features
