"""A trigram language model behind the engine interface: its sequence distribution is known exactly.

The logits after token x_i are log p(. | x_{i-1}, x_i), where x_{i-1} is x_i's parent: the latest new
token x_i may see under the tree mask, else the row's last cached token (so a strategy that builds a
wrong tree mask or cache gets wrong distributions). It supports everything the engine step uses (ragged rows,
tree masks, rollback, keep, row views, select_rows), so sampling can be checked against closed-form
distributions: :func:`trigram_generator` runs the runtime's own ``Generator.generate_ids`` over a trigram pair.
"""
from __future__ import annotations

import copy
import numpy as np

from ssd_trt.engines.base import EngineDefaults, EngineSpec
from ssd_trt.engines.limits import EngineLimits
from ssd_trt.engines.rows import check_order, reorder
from ssd_trt.recipe import DecodingDefaults
from tests.engine_generator import GeneratorOverEngines


class TrigramEngine(EngineDefaults):
    def __init__(self, log_table: np.ndarray, max_batch: int = 4096, max_context: int = 512,
                 name: str = "trigram") -> None:
        self.table = np.asarray(log_table, dtype=np.float64)          # [V, V, V]: (parent, token) -> next
        vocab = self.table.shape[0]
        self.spec = EngineSpec(name=name, vocab_size=vocab, num_layers=1, num_kv_heads=1, head_dim=1,
                               max_batch=max_batch, max_context=max_context)
        self.tokens = np.zeros((0, max_context), dtype=np.int64)
        self._lengths = np.zeros(0, dtype=np.int32)

    def reset(self, batch: int) -> None:
        self.tokens = np.zeros((batch, self.spec.max_context), dtype=np.int64)
        self._lengths = np.zeros(batch, dtype=np.int32)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths.copy()

    def forward(self, input_ids, position_ids, tree_mask=None, logit_indices=None) -> np.ndarray:
        batch, num_new = input_ids.shape
        mask = np.tril(np.ones((num_new, num_new), dtype=bool))[None].repeat(batch, 0) \
            if tree_mask is None else np.asarray(tree_mask, dtype=bool)
        previous = np.zeros((batch, num_new), dtype=np.int64)
        for row in range(batch):
            start = self._lengths[row]
            last_cached = self.tokens[row, start - 1] if start > 0 else 0
            for i in range(num_new):
                visible = np.flatnonzero(mask[row, i, :i])
                previous[row, i] = input_ids[row, visible[-1]] if visible.size else last_cached
            self.tokens[row, start:start + num_new] = input_ids[row]
        self._lengths += num_new
        logits = self.table[previous, input_ids]
        return logits if logit_indices is None else np.take_along_axis(logits, np.asarray(logit_indices)[..., None], 1)

    def rollback(self, lengths) -> None:
        self._lengths[:] = np.asarray(lengths, dtype=np.int32)    # in place: row views share the array

    def select_rows(self, order) -> None:
        check_order(order, len(self._lengths))
        self.tokens, self._lengths = reorder(self.tokens, order), reorder(self._lengths, order)

    def rows(self, start: int, stop: int) -> "TrigramEngine":
        """Rows ``start .. stop-1``: the same model over slices of this engine's token table and lengths."""
        view = copy.copy(self)
        view.tokens, view._lengths = self.tokens[start:stop], self._lengths[start:stop]
        return view

    def keep(self, row: int, start: int, offsets) -> None:
        offsets = np.asarray(offsets, dtype=np.int64)
        self.tokens[row, start:start + offsets.size] = self.tokens[row, start + offsets].copy()
        self._lengths[row] = start + offsets.size


def random_log_table(vocab: int, seed: int, sharpness: float = 1.5) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((vocab, vocab, vocab)) * sharpness
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def blend(table: np.ndarray, other: np.ndarray, weight: float) -> np.ndarray:
    """A related draft: log of (1-w) p + w p_other."""
    mixed = (1 - weight) * np.exp(table) + weight * np.exp(other)
    return np.log(mixed)


def trigram_generator(target, draft=None, max_batch: int = 256, max_context: int = 512,
                     defaults: DecodingDefaults = DecodingDefaults(sd_draft_len=2, ssd_draft_len=2,
                                                                   ssd_fan_out_budget=4)) -> GeneratorOverEngines:
    """The runtime's Generator over a trigram target and draft: tables, or makers of engines (e.g. a draft with
    injected faults, made again after it fails)."""
    def maker(model, name):
        return model if callable(model) else (lambda: TrigramEngine(model, max_batch, max_context, name))
    limits = EngineLimits(max_batch=max_batch, max_context=max_context, max_draft_len=8, max_tree_size=64)
    return GeneratorOverEngines(maker(target, "target"), None if draft is None else maker(draft, "draft"), limits,
                                defaults)
