"""The KV cache every numpy-backed engine owns: one buffer per layer and kind, with a length per row.

Capacity grows geometrically (doubling, capped at max_context), so a sequence of n tokens is copied
O(log n) times in total, and attention reads at most twice the live prefix. Rollback is O(1): the
length shrinks and later writes overwrite the stale slots (attention never reads past the length).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ssd_trt.engines.base import EngineSpec, check_batch, check_keep, check_room, checked_rollback
from ssd_trt.engines.rows import check_order, reorder

INITIAL_CAPACITY = 128


class KVCache:
    """Buffers [rows, Hkv, S, D] per layer and kind. ``rows`` >= the live batch: continuous batching moves
    rows in place (``select_rows``) and a leaving sequence frees its row without copying the others."""

    def __init__(self, spec: EngineSpec, batch: int) -> None:
        check_batch(spec, batch)
        self.spec = spec
        self.lengths = np.zeros(batch, dtype=np.int32)
        self.buffers: list[np.ndarray] = []
        self._allocate(batch, min(INITIAL_CAPACITY, spec.max_context))

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2]

    def _allocate(self, rows: int, capacity: int) -> None:
        s = self.spec
        shape = (rows, s.num_kv_heads, capacity, s.head_dim)
        new = [np.zeros(shape, dtype=np.float32) for _ in range(2 * s.num_layers)]
        for old, fresh in zip(self.buffers, new):
            kept = min(old.shape[0], rows)
            fresh[:kept, :, :old.shape[2]] = old[:kept]
        self.buffers = new

    def reserve(self, num_new: int) -> bool:
        """Make room for ``num_new`` more tokens in every row; True when the buffers were replaced."""
        check_room(self.spec, int(self.lengths.max()), num_new)
        needed = int(self.lengths.max()) + num_new
        if needed <= self.capacity:
            return False
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        self._allocate(self.buffers[0].shape[0], min(capacity, self.spec.max_context))
        return True

    def rollback(self, lengths: np.ndarray) -> None:
        self.lengths = checked_rollback(self.lengths, lengths)

    def select_rows(self, order: Sequence[int | None]) -> bool:
        """The batch becomes ``order``: old rows kept or None for an empty row (``engines/rows.py``). Only rows
        whose index changes are copied; True when the buffers were replaced (more rows than allocated)."""
        check_order(order, self.batch)
        check_batch(self.spec, len(order))
        grown = len(order) > self.buffers[0].shape[0]
        if grown:
            self._allocate(min(max(len(order), 2 * self.buffers[0].shape[0]), self.spec.max_batch), self.capacity)
        moves = [(new, old) for new, old in enumerate(order) if old is not None and old != new]
        if moves:
            targets, sources = [new for new, _ in moves], [old for _, old in moves]
            for buffer in self.buffers:
                buffer[targets] = buffer[sources]          # gathered first (a copy): rows may overlap
        self.lengths = reorder(self.lengths, order)
        return grown

    def keep(self, row: int, start: int, offsets: Sequence[int]) -> None:
        """Compact a tree step: slots start+offsets[i] become start+i (the accepted path)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        check_keep(self.lengths, row, start, offsets)
        if offsets.size and not np.array_equal(offsets, np.arange(offsets.size)):
            for buffer in self.buffers:
                view = buffer[row]                     # [H, S, D]; index slots on axis 1
                view[:, start:start + offsets.size] = view[:, start + offsets]
        self.lengths[row] = start + offsets.size
