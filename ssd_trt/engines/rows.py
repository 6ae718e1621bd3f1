"""Row management for continuous batching: sequences join and leave an engine's batch between steps.

* ``select_rows(order)``: the new batch is ``order`` -- each entry an old row to keep (its cache moved, O(its
  length)) or None for a fresh, empty row. The engine step (``batching/engine.py``) calls it only when the set of
  running sequences changes, never per step.
* ``rows(start, stop)``: an engine over the contiguous rows ``start .. stop-1`` only, sharing the cache. A
  prefill of the sequences that just joined, or a draft step of the rows that draft, pays for those rows alone.
  :class:`PaddedRows` is the view any engine gets by default: it runs the whole batch and pads the other rows
  with a discarded token (right on a GPU, where a step's cost barely depends on its rows); the ONNX Runtime
  engine and the native CPU engine have a view that runs the slice only (:class:`CacheRows`).
"""
from __future__ import annotations

from typing import ContextManager, Mapping, Sequence

import numpy as np

from ssd_trt.engines.base import EngineDefaults, check_keep, checked_rollback


def check_order(order: Sequence[int | None], batch: int) -> None:
    """``order`` must name existing rows at most once each."""
    kept = [row for row in order if row is not None]
    if len(set(kept)) != len(kept) or any(not 0 <= row < batch for row in kept):
        raise ValueError(f"select_rows: rows to keep must be distinct and in [0, {batch}); got {list(order)}")


def reorder(array: np.ndarray, order: Sequence[int | None], fill=0) -> np.ndarray:
    """``array``'s rows in ``order`` (None: a row of ``fill``)."""
    out = np.full((len(order),) + array.shape[1:], fill, dtype=array.dtype)
    for new, old in enumerate(order):
        if old is not None:
            out[new] = array[old]
    return out


class PaddedRows(EngineDefaults):
    """Rows ``start .. stop-1`` of ``parent``: each step runs every row, the others fed one discarded token per
    new token (at their own next positions, rolled back at once), so no other row changes."""

    def __init__(self, parent, start: int, stop: int) -> None:
        self.parent, self.start, self.stop = parent, start, stop
        self.spec = parent.spec

    @property
    def lengths(self) -> np.ndarray:
        return self.parent.lengths[self.start:self.stop]

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray | None = None,
                logit_indices: np.ndarray | None = None,
                extra: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        before = self.parent.lengths
        batch, tokens = len(before), input_ids.shape[1]
        ids = np.zeros((batch, tokens), dtype=np.int64)
        positions = before[:, None].astype(np.int64) + np.arange(tokens)[None, :]
        ids[self.start:self.stop], positions[self.start:self.stop] = input_ids, position_ids
        mask = None
        if tree_mask is not None:
            mask = np.broadcast_to(np.tril(np.ones((tokens, tokens), dtype=bool)), (batch, tokens, tokens)).copy()
            mask[self.start:self.stop] = tree_mask
        indices = None
        if logit_indices is not None:
            indices = np.zeros((batch, np.asarray(logit_indices).shape[1]), dtype=np.int64)
            indices[self.start:self.stop] = logit_indices
        if extra is None:
            logits = self.parent.forward(ids, positions, mask, indices)
        else:                    # a feature draft's per-token inputs: zeros for the padding rows
            padded = {}
            for name, value in extra.items():
                padded[name] = np.zeros((batch,) + value.shape[1:], dtype=value.dtype)
                padded[name][self.start:self.stop] = value
            logits = self.parent.forward(ids, positions, mask, indices, extra=padded)
        after = self.parent.lengths
        after[:self.start], after[self.stop:] = before[:self.start], before[self.stop:]
        self.parent.rollback(after)
        return logits[self.start:self.stop]

    def alone(self, spin: bool = False) -> ContextManager[None]:
        return self.parent.alone(spin)

    # a feature pair's members: this view's rows of the parent's last step
    @property
    def has_features(self) -> bool:
        return self.parent.has_features

    @property
    def last_features(self) -> np.ndarray | None:
        features = self.parent.last_features
        return None if features is None else features[self.start:self.stop]

    @property
    def extra_widths(self) -> Mapping[str, int]:
        return self.parent.extra_widths

    @property
    def last_hidden(self) -> np.ndarray | None:
        hidden = self.parent.last_hidden
        return None if hidden is None else hidden[self.start:self.stop]

    def rollback(self, lengths: np.ndarray) -> None:
        full = self.parent.lengths
        full[self.start:self.stop] = checked_rollback(full[self.start:self.stop], lengths)
        self.parent.rollback(full)

    def keep(self, row: int, start: int, offsets: Sequence[int]) -> None:
        check_keep(self.lengths, row, start, np.asarray(offsets, dtype=np.int64))
        self.parent.keep(self.start + row, start, offsets)


class CacheRows(EngineDefaults):
    """Rows ``start .. stop-1`` of an engine that owns a :class:`~ssd_trt.engines.kv_cache.KVCache` (ONNX Runtime's,
    the native CPU engine) as an engine of their own: its steps run those rows only (the parent's ``forward_rows``),
    on their slice of the shared cache."""

    def __init__(self, parent, start: int, stop: int) -> None:
        self.parent, self.start, self.stop = parent, start, stop
        self.spec = parent.spec

    @property
    def lengths(self) -> np.ndarray:
        return self.parent.cache.lengths[self.start:self.stop].copy()

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray | None = None,
                logit_indices: np.ndarray | None = None,
                extra: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        return self.parent.forward_rows(self.start, self.stop, input_ids, position_ids, tree_mask, logit_indices,
                                        extra)

    # a feature pair's members: the parent's last step ran these rows only
    @property
    def has_features(self) -> bool:
        return self.parent.has_features

    @property
    def last_features(self) -> np.ndarray | None:
        return self.parent.last_features

    @property
    def extra_widths(self) -> Mapping[str, int]:
        return self.parent.extra_widths

    @property
    def last_hidden(self) -> np.ndarray | None:
        return self.parent.last_hidden

    def alone(self, spin: bool = False) -> ContextManager[None]:
        return self.parent.alone(spin)

    def rollback(self, lengths: np.ndarray) -> None:
        cache = self.parent.cache
        cache.lengths[self.start:self.stop] = checked_rollback(cache.lengths[self.start:self.stop], lengths)

    def keep(self, row: int, start: int, offsets: Sequence[int]) -> None:
        if not 0 <= row < self.stop - self.start:
            raise ValueError(f"row must be in [0, {self.stop - self.start}), got {row}")
        self.parent.cache.keep(self.start + row, start, offsets)
