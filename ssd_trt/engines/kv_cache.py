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
    def __init__(self, spec: EngineSpec, batch: int) -> None:
        check_batch(spec, batch)
        self.spec = spec
        self.lengths = np.zeros(batch, dtype=np.int32)
        self.buffers: list[np.ndarray] = []
        self._allocate(min(INITIAL_CAPACITY, spec.max_context))

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2]

    def _allocate(self, capacity: int) -> None:
        s = self.spec
        shape = (self.batch, s.num_kv_heads, capacity, s.head_dim)
        new = [np.zeros(shape, dtype=np.float32) for _ in range(2 * s.num_layers)]
        for old, fresh in zip(self.buffers, new):
            fresh[:, :, :old.shape[2]] = old
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
        self._allocate(min(capacity, self.spec.max_context))
        return True

    def rollback(self, lengths: np.ndarray) -> None:
        self.lengths = checked_rollback(self.lengths, lengths)

    def select_rows(self, order: Sequence[int | None]) -> None:
        """The batch becomes ``order``: old rows kept (their slots copied) or None for an empty row
        (``engines/rows.py``); the capacity is kept."""
        check_order(order, self.batch)
        check_batch(self.spec, len(order))
        self.buffers = [reorder(buffer, order) for buffer in self.buffers]
        self.lengths = reorder(self.lengths, order)

    def keep(self, row: int, start: int, offsets: Sequence[int]) -> None:
        """Compact a tree step: slots start+offsets[i] become start+i (the accepted path)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        check_keep(self.lengths, row, start, offsets)
        if offsets.size and not np.array_equal(offsets, np.arange(offsets.size)):
            for buffer in self.buffers:
                view = buffer[row]                     # [H, S, D]; index slots on axis 1
                view[:, start:start + offsets.size] = view[:, start + offsets]
        self.lengths[row] = start + offsets.size
