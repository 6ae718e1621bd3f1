"""A wrapper around a backend engine that knows which token sits in each of its KV-cache slots.

Wrappers that change what a draft step computes from the tokens *before* each new token (the copy
component's n-gram match, a feature draft's parent on the token's path) need the context of every token
they are fed. The backend engine keeps only keys and values; this base mirrors its cache with the token
ids, following it through every step shape the strategies use (chains, right-padded ragged feeds, tree
steps) and through ``rollback`` and ``keep`` (the tree's accepted path compacted in place).
"""
from __future__ import annotations

import copy
from typing import Sequence

import numpy as np

from ssd_trt.engines.base import EngineDefaults, EngineSpec
from ssd_trt.engines.rows import reorder


class TokenMirrorEngine(EngineDefaults):
    """Base of the wrappers: ``inner`` is any engine; subclasses override ``forward`` and call
    :meth:`_record` after the inner step (with the cache lengths from before it). A wrapper presents the plain
    step (no extra inputs, no features of its own) and passes the target's features through to a feature
    draft beneath it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.spec: EngineSpec = inner.spec
        self._slots = np.zeros((0, self.spec.max_context), dtype=np.int64)

    def reset(self, batch: int) -> None:
        self.inner.reset(batch)
        self._slots = np.zeros((batch, self.spec.max_context), dtype=np.int64)

    @property
    def lengths(self) -> np.ndarray:
        return self.inner.lengths

    def select_rows(self, order: Sequence[int | None]) -> None:
        self.inner.select_rows(order)
        self._slots = reorder(self._slots, order)

    def rows(self, start: int, stop: int) -> "TokenMirrorEngine":
        """Rows ``start .. stop-1`` (``engines/rows.py``): this wrapper over the inner engine's view, mirroring
        into the same slot table."""
        view = copy.copy(self)
        view.inner = self.inner.rows(start, stop)
        view._slots = self._slots[start:stop]
        return view

    def cached_tokens(self, row: int, start: int = 0) -> np.ndarray:
        """The token ids in slots ``start`` .. length-1 of ``row`` (what the cache holds keys for)."""
        return self._slots[row, start:int(self.inner.lengths[row])]

    @staticmethod
    def visible(input_ids: np.ndarray, tree_mask: np.ndarray | None, row: int, i: int) -> np.ndarray:
        """The new tokens that token ``i`` of ``row`` sees in this step: all before it in a chain, its
        ancestors (and itself) in a tree step."""
        tokens = input_ids[row, :i + 1]
        return tokens if tree_mask is None else tokens[tree_mask[row, i, :i + 1]]

    def _record(self, input_ids: np.ndarray, start: np.ndarray) -> None:
        """The step fed ``input_ids`` [B, T] at slots ``start[row]`` onwards."""
        steps = input_ids.shape[1]
        for row in range(input_ids.shape[0]):
            self._slots[row, start[row]:start[row] + steps] = input_ids[row]

    def rollback(self, lengths: np.ndarray) -> None:
        self.inner.rollback(lengths)        # slots past the new length are dead; later writes overwrite

    def keep(self, row: int, start: int, offsets: Sequence[int]) -> None:
        self.inner.keep(row, start, offsets)
        self._slots[row, start:start + len(offsets)] = self._slots[row, [start + o for o in offsets]]

    @property
    def takes_target_features(self) -> bool:
        return self.inner.takes_target_features

    def receive_target_features(self, row: int, first: int, features: np.ndarray) -> None:
        self.inner.receive_target_features(row, first, features)
