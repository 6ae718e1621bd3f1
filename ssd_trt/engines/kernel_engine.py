"""The CPU engine on ssd-trt's own kernels: a whole decoder step in C (``kernels/csrc/step.c``) around the block
matmul over the GGUF file's own tiles (``kernels/``), on the same numpy KV cache as the ONNX Runtime engine.

Every step is row-exact by construction (``kernels/csrc/ssd_step.h``): a token's logits do not depend on the step
that computed them, so greedy SD chains, SD token trees and SSD are token-identical to autoregressive decoding with
no padding or one-token-twice trick, and a one-token step computes one row.

Threads: the step's matmuls split their output columns over a pool (the caller's thread, pinned by the runtime, and
``threads - 1`` workers on ``cores[1:]``); the rest of the step runs on the caller's thread. With ``alone_threads`` >
``threads``, steps taken inside :meth:`alone` (the other model idle) run on a wider pool over ``alone_cores``, with
the same results bit for bit (the column split changes no sum).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from ssd_trt_plugins.tree_attention.masks import causal_tree_mask, pack_tree_mask
from ssd_trt.engines.base import EngineDefaults, EngineSpec, all_indices, check_room
from ssd_trt.engines.kv_cache import KVCache
from ssd_trt.engines.rows import CacheRows, check_order
from ssd_trt.kernels.artifact import CpuTiles
from ssd_trt.kernels.native import DEFAULT_SPIN_US, Kernels
from ssd_trt.kernels.step import ModelStep

# microseconds a pool's workers poll for the next matmul before they sleep, where the cores are shared (or the
# other model's job follows on them): long enough to bridge the gaps between one step's matmuls (its norms and
# attention, tens of microseconds at decode), short enough to leave the core soon after the step
SHARED_SPIN_US = 50


class KernelEngine(EngineDefaults):
    def __init__(self, tiles: CpuTiles, spec: EngineSpec, threads: int = 1, cores: Sequence[int] | None = None,
                 spin: bool = True, alone_threads: int = 1, alone_cores: Sequence[int] | None = None,
                 path: str = "auto") -> None:
        """``tiles``: the build's artifact (``kernels/artifact.py``); ``spin``: the pool's workers poll between
        steps for a while (else only between one step's matmuls, ``SHARED_SPIN_US``: another model shares the
        cores); ``path``: the kernel path (``auto``: the best this CPU runs). Raises KernelBuildError when the
        library cannot be built, ValueError when this CPU cannot run it."""
        self.spec = spec
        self.step = ModelStep(tiles)
        if tiles.shape["num_layers"] != spec.num_layers or tiles.shape["vocab_size"] != spec.vocab_size:
            raise ValueError(f"{spec.name}: the CPU tiles are of another model ({tiles.shape})")
        if self.step.positions < spec.max_context:
            raise ValueError(f"{spec.name}: the CPU tiles' rotary table has {self.step.positions} positions, the "
                             f"engine's context is {spec.max_context}; rebuild")
        self.pool = Kernels(path, threads, _cores(cores, threads), DEFAULT_SPIN_US if spin else SHARED_SPIN_US)
        if "avx2" not in self.pool.available_paths():
            raise ValueError("the native step needs AVX2 and FMA, which this CPU lacks")
        self.path = self.pool.path
        # inside alone(): a wider pool, spinning between steps or not
        self.alone_pools: dict[bool, Kernels] = {}
        if alone_threads > threads:
            for spinning in (False, True):
                self.alone_pools[spinning] = Kernels(path, alone_threads, _cores(alone_cores, alone_threads),
                                                     DEFAULT_SPIN_US if spinning else SHARED_SPIN_US)
        self._alone: bool | None = None
        self.cache: KVCache | None = None
        self._addresses: dict = {}

    @contextmanager
    def alone(self, spin: bool = False) -> Iterator[None]:
        previous, self._alone = self._alone, spin if self.alone_pools else None
        try:
            yield
        finally:
            self._alone = previous

    def _pool(self) -> Kernels:
        return self.pool if self._alone is None else self.alone_pools[self._alone]

    def reset(self, batch: int) -> None:
        self.cache = KVCache(self.spec, batch)
        self._addresses = {}

    def select_rows(self, order: Sequence[int | None]) -> None:
        if self.cache is None:
            check_order(order, 0)
            self.reset(len(order))
        elif self.cache.select_rows(order):    # rows moved in place keep their addresses; new buffers do not
            self._addresses = {}

    def rows(self, start: int, stop: int) -> CacheRows:
        return CacheRows(self, start, stop)

    @property
    def lengths(self) -> np.ndarray:
        return self.cache.lengths.copy()

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray | None = None,
                logit_indices: np.ndarray | None = None, extra=None) -> np.ndarray:
        if input_ids.shape[0] != self.cache.batch:
            raise ValueError(f"{self.spec.name}: batch {input_ids.shape[0]} does not match the reset batch "
                             f"{self.cache.batch}")
        return self.forward_rows(0, self.cache.batch, input_ids, position_ids, tree_mask, logit_indices, extra)

    def forward_rows(self, start: int, stop: int, input_ids: np.ndarray, position_ids: np.ndarray,
                     tree_mask: np.ndarray | None = None, logit_indices: np.ndarray | None = None,
                     extra=None) -> np.ndarray:
        if extra:
            raise ValueError(f"{self.spec.name}: the native step takes no extra inputs, got {sorted(extra)}")
        cache = self.cache
        batch, num_new = input_ids.shape
        if batch != stop - start or not 0 <= start < stop <= cache.batch:
            raise ValueError(f"{self.spec.name}: {batch} rows fed to rows {start}..{stop - 1} of a batch of "
                             f"{cache.batch}")
        check_room(self.spec, int(cache.lengths[start:stop].max()), num_new)
        if cache.reserve(num_new):
            self._addresses = {}
        packed = causal_tree_mask(batch, num_new) if tree_mask is None else pack_tree_mask(tree_mask)
        indices = all_indices(batch, num_new) if logit_indices is None else np.asarray(logit_indices)
        logits = np.empty((batch, indices.shape[1], self.spec.vocab_size), dtype=np.float32)
        keys, values = self._cache_addresses(start)
        self.step.run(self._pool(), input_ids, position_ids, packed, cache.lengths[start:stop], indices, keys, values,
                      cache.capacity, logits)
        cache.lengths[start:stop] += num_new
        return logits

    def _cache_addresses(self, start: int) -> tuple[list[int], list[int]]:
        """Each layer's key and value buffer address at row ``start`` (kept until the buffers change)."""
        if start not in self._addresses:
            buffers = self.cache.buffers
            row = buffers[0][0].nbytes
            self._addresses[start] = ([b.ctypes.data + start * row for b in buffers[0::2]],
                                      [b.ctypes.data + start * row for b in buffers[1::2]])
        return self._addresses[start]

    def rollback(self, lengths: np.ndarray) -> None:
        self.cache.rollback(lengths)

    def keep(self, row: int, start: int, offsets: Sequence[int]) -> None:
        self.cache.keep(row, start, offsets)

    def close(self) -> None:
        for pool in (self.pool, *self.alone_pools.values()):
            pool.close()


def _cores(cores: Sequence[int] | None, threads: int) -> list[int] | None:
    """The pool's cores: ``threads`` of them (cycled when fewer are given), None to let the OS place them."""
    if not cores:
        return None
    return [cores[i % len(cores)] for i in range(threads)]
