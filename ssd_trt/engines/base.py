"""The engine interface every backend implements (ONNX Runtime, TensorRT, torch eager).

An engine owns one model's KV cache for ``batch`` sequences ("rows"). Every call of :meth:`forward`
appends T new tokens to every row (ragged prefix lengths are allowed) and returns their logits.
Strategies (autoregressive, speculative, saguaro) only ever talk to this interface.

Step-graph I/O (identical for every backend, names shared with the exported ONNX):
  inputs   input_ids [B,T] int64, position_ids [B,T] int64, tree_mask [B,T,ceil(T/32)] int32
           (packed bits, see plugins/tree_attention/reference.py), cache_lengths [B] int32,
           logit_indices [B,L] int64 (which of the T new tokens get logits: a step pays the LM head
           only where the strategy reads it, e.g. a prompt's last token, an SSD tree step's newest
           branch tokens), past_key_{i}, past_value_{i} [B,Hkv,S,D] float32 for layer i
  outputs  logits [B,L,V] float32, present_key_{i}, present_value_{i} [B,Hkv,S,D] (the caches with
           the T new entries written at slots cache_lengths[b] .. cache_lengths[b]+T-1)
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from types import MappingProxyType
from typing import ContextManager, Mapping, Protocol, Sequence

import numpy as np

GRAPH_INPUTS = ("input_ids", "position_ids", "tree_mask", "cache_lengths", "logit_indices")
GRAPH_OUTPUT_LOGITS = "logits"
GRAPH_OUTPUT_FEATURES = "features"    # optional, last: a target's hidden states for a feature draft (EAGLE-3)
# a feature draft's step graph (EAGLE-3, models/eagle3.py) also takes, per new token, the target's features
# [B,T,F], the draft's own carried hidden [B,T,H] and which of the two it carries [B,T] bool (after GRAPH_INPUTS,
# before the caches), and returns its output hidden [B,T,H] last: engines/feature_draft.py feeds them
EAGLE3_INPUTS = ("features", "draft_hidden", "from_target")
EAGLE3_OUTPUT_HIDDEN = "hidden"
# model metadata of a step graph that attends a one-token step as two queries (export/fused_graph.py): it
# writes one KV slot past the step, and its one-token steps are row-exact without the engine's padding
GRAPH_META_ONE_TOKEN_TWICE = "one_token_steps_attended_twice"


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key_{layer}", f"past_value_{layer}"


def present_names(layer: int) -> tuple[str, str]:
    return f"present_key_{layer}", f"present_value_{layer}"


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Static facts about a compiled model that the runtime needs."""
    name: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_batch: int
    max_context: int


class EngineDefaults:
    """The optional members of every engine, plain by default; an engine whose step does more says so by
    overriding them, so nothing probes for them.

    * ``exact_trees``: a token tree's tokens get the logits they would get one at a time, so SD token trees are as
      lossless as chains (False on ONNX Runtime's int8-activation graph: ``Generator.check_request`` refuses trees).
    * :meth:`alone`: steps taken inside it may use the cores of a model that is idle meanwhile (the ONNX Runtime
      target's wider sessions: ``engines/ort.py``); ``spin``: the other model stays idle after them too (no job of
      its follows soon), so the step's threads may keep spinning between steps. Elsewhere they run as placed.

    The feature-pair (EAGLE-3) members:

    * a target exported for a feature draft: ``has_features``, and after each step ``last_features`` [B, T, F]
      (the residual stream the draft reads; ``decoding/feature_relay.py`` hands it over);
    * a feature draft's backend engine: ``extra_widths``, the width of each extra per-token input its step
      takes (``EAGLE3_INPUTS``), and its output ``last_hidden`` (read by ``feature_draft.FeatureDraftEngine``);
    * a draft that accepts the target's features of verified tokens: ``takes_target_features`` and
      :meth:`receive_target_features` (``FeatureDraftEngine``, and the wrappers around one).
    """
    exact_trees: bool = True     # a token's logits in a tree step equal its logits alone (False: trees are refused)
    has_features: bool = False
    last_features: np.ndarray | None = None
    extra_widths: Mapping[str, int] = MappingProxyType({})
    last_hidden: np.ndarray | None = None
    takes_target_features: bool = False

    def receive_target_features(self, row: int, first: int, features: np.ndarray) -> None:
        raise TypeError(f"{type(self).__name__} is no feature draft: it takes no target features")

    def alone(self, spin: bool = False) -> ContextManager[None]:
        return nullcontext()


class Engine(Protocol):
    """Every engine also has :class:`EngineDefaults`'s members (backends and wrappers inherit its plain defaults)."""
    spec: EngineSpec
    has_features: bool
    last_features: np.ndarray | None
    extra_widths: Mapping[str, int]
    takes_target_features: bool

    def reset(self, batch: int) -> None:
        """Start ``batch`` empty sequences (frees any previous cache)."""

    @property
    def lengths(self) -> np.ndarray:
        """Current cache length of every row, int32 [B] (a copy)."""

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray | None = None,
                logit_indices: np.ndarray | None = None) -> np.ndarray:
        """Append ``input_ids`` [B,T] to every row and return logits float32 [B,L,V].

        ``tree_mask`` is bool [B,T,T] (token i may see new token j); None means causal (chain).
        ``logit_indices`` [B,L] picks the new tokens whose logits are returned (None: all T, L = T).
        """

    def rollback(self, lengths: np.ndarray) -> None:
        """Truncate every row's cache to ``lengths`` [B] (<= current); later writes overwrite."""

    def select_rows(self, order: Sequence[int | None]) -> None:
        """Continuous batching: the batch becomes ``order``, each an old row kept (with its cache) or None for a
        new empty row (``engines/rows.py``)."""

    def rows(self, start: int, stop: int) -> "Engine":
        """An engine over rows ``start .. stop-1`` only, sharing this one's cache (``engines/rows.py``)."""

    def keep(self, row: int, start: int, offsets: Sequence[int]) -> None:
        """After a tree step: keep slots ``start + offsets[i]`` of ``row`` as slots ``start + i``
        (the accepted path) and set that row's length to ``start + len(offsets)``."""


def all_indices(batch: int, tokens: int) -> np.ndarray:
    """``logit_indices`` for every new token of a step: [B, T] int64."""
    return np.broadcast_to(np.arange(tokens, dtype=np.int64), (batch, tokens))


def last_indices(batch: int, tokens: int, count: int) -> np.ndarray:
    """``logit_indices`` for the last ``count`` new tokens of a step: [B, count] int64."""
    return np.broadcast_to(np.arange(tokens - count, tokens, dtype=np.int64), (batch, count))


# -- the engine invariants, checked by every engine with these helpers (one definition each) ---------
def check_batch(spec: EngineSpec, batch: int) -> None:
    """A reset must ask for 1..max_batch rows."""
    from ssd_trt.errors import RequestError
    if not 1 <= batch <= spec.max_batch:
        raise RequestError(f"batch {batch} is outside this engine's range 1..{spec.max_batch} ({spec.name}); "
                           f"rebuild with a larger engine.max_batch or send fewer prompts")


def check_room(spec: EngineSpec, longest: int, num_new: int) -> None:
    """The cache must hold ``num_new`` more tokens after the longest row (a request that passed
    ``requests.check_request`` always fits; this guards the engine's buffers)."""
    from ssd_trt.errors import RequestError
    if longest + num_new > spec.max_context:
        raise RequestError(f"{spec.name}: {longest + num_new} tokens exceed the engine's max context "
                           f"{spec.max_context}; shorten the prompt or max_new_tokens, or rebuild with a larger "
                           f"engine.max_context")


def checked_rollback(current: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``lengths`` as int32 when it is a valid rollback of ``current`` (same rows, 0 <= new <= current)."""
    new = np.asarray(lengths, dtype=np.int32)
    if new.shape != current.shape or (new < 0).any() or (new > current).any():
        raise ValueError(f"rollback lengths must be [{len(current)}] ints in [0, current lengths "
                         f"{current.tolist()}], got {new.tolist()}")
    return new.copy()


def check_keep(current: np.ndarray, row: int, start: int, offsets: np.ndarray) -> None:
    """``keep`` may only move slots of ``row`` that exist: start + offsets in [start, length)."""
    if not 0 <= row < len(current):
        raise ValueError(f"row must be in [0, {len(current)}), got {row}")
    length = int(current[row])
    if not 0 <= start <= length or (offsets < 0).any() or (start + offsets >= length).any():
        raise ValueError(f"keep: slots start + offsets must lie in [start, {length}) for row {row}; got start "
                         f"{start}, offsets {offsets.tolist()}")
