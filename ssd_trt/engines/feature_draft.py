"""A feature draft (EAGLE-3, ``models/eagle3.py``) behind the plain engine interface: which features each
token it is fed carries.

Strategies feed a feature draft exactly as they feed an independent one (chains, ragged feeds, tree steps;
``engines/base.py``); this adapter adds, per new token, what the EAGLE-3 layer reads besides the token
(issue 19, item 3). Features lag tokens by one: the token at position p is conditioned on the token at p-1 and
carries

  * the **target's features of position p-1** when the target has verified the token there: verified tokens
    carry the target's features. The strategies hand them over as the target returns them
    (:meth:`FeatureDraftEngine.receive_target_features`, via ``decoding/feature_relay.py``): after the prefill
    (the prompt), after every verification (t*_prev, s_1..s_k: the tokens it accepted), never a rejected one;
  * otherwise the **draft's own output at p-1 on this token's path** (its predicted feature, ``hidden'``):
    tokens not yet verified carry the draft's own features. The draft remembers its output for every token it
    was fed, keyed by the token's path (position and the tokens before it), so a token is matched with
    the output of *its* parent: in a tree step, the branch it sits on; after a rollback, the same tokens fed
    again find the same parent.

What this means in each mode:
  * SD chain: the pending tokens (verified) carry target features; drafted s_i carries the draft's output
    for s_{i-1}; the first drafted token carries the draft's output for the bonus token (the target has
    not computed the bonus token's features: it is the next verification's first token).
  * SD tree: every node carries its parent node's draft output (computed when the parent's level was fed).
  * SSD: while the target verifies [t*_prev, s_1..s_K] the draft's glue decode feeds that speculation with
    the draft's own features (the target's are not there yet): s_i carries the output the draft computed
    for s_{i-1} when it drafted it, in the just-in-time chain or in the tree branch the speculation came from
    (so an outcome (k, t*) is pre-drafted behind s_1..s_k that carry draft features only). When the
    verification returns, the accepted glue is committed with the target's features: from then on every
    token fed behind it is conditioned on those (the glue step replaces the draft's features with the
    target's).

A token whose parent the draft has not computed in an earlier step (its parent is new in the same step, or
the speculation came from prompt lookup, which runs no network) carries the nearest ancestor's feature
that exists, counted in :attr:`FeatureDraftEngine.fallbacks`: only the acceptance rate depends on which
features a token carries, never the output (every proposal is verified by the target).

The path key is the position and the last ``PATH_WINDOW`` tokens up to it. Two paths of one row that reach
the same position agree on every verified token, and speculation never runs ``PATH_WINDOW`` tokens past
the verified prefix (K + 1 glue tokens and K branch tokens, K <= engines.limits.MAX_DRAFT_LEN), so the
window tells every live path apart.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ssd_trt.engines.limits import MAX_DRAFT_LEN
from ssd_trt.engines.rows import reorder
from ssd_trt.engines.token_mirror import TokenMirrorEngine

PATH_WINDOW = 4 * MAX_DRAFT_LEN + 4


class FeatureDraftEngine(TokenMirrorEngine):
    """Wraps an engine whose step takes ``features``, ``draft_hidden``, ``from_target`` and returns ``hidden``
    (``forward(..., extra=)`` and ``last_hidden`` of ``OrtEngine`` and ``DeviceStepEngine``: ONNX Runtime, TensorRT,
    torch); presents the plain :class:`~ssd_trt.engines.base.Engine` interface."""

    takes_target_features = True

    def __init__(self, inner, feature_width: int, hidden_size: int) -> None:
        super().__init__(inner)
        self.feature_width, self.hidden_size = feature_width, hidden_size
        # tokens that carried an ancestor's feature, not their parent's (one counter shared with the row views)
        self._fallbacks = np.zeros(1, dtype=np.int64)
        self._target = np.zeros((0, self.spec.max_context, feature_width), dtype=np.float32)
        self._known = np.zeros(0, dtype=np.int64)              # positions 0..known-1 have the target's features
        self._memo: list[dict[tuple[int, bytes], np.ndarray]] = []

    def reset(self, batch: int) -> None:
        super().reset(batch)
        if self._target.shape[0] != batch:
            self._target = np.zeros((batch, self.spec.max_context, self.feature_width), dtype=np.float32)
        self._known = np.zeros(batch, dtype=np.int64)
        self._memo = [{} for _ in range(batch)]
        self._fallbacks[0] = 0

    def select_rows(self, order) -> None:
        super().select_rows(order)
        self._target = reorder(self._target, order)
        self._known = reorder(self._known, order)
        self._memo = [{} if old is None else self._memo[old] for old in order]

    def rows(self, start: int, stop: int) -> "FeatureDraftEngine":
        view = super().rows(start, stop)
        view._target, view._known, view._memo = self._target[start:stop], self._known[start:stop], \
            self._memo[start:stop]
        return view

    def receive_target_features(self, row: int, first: int, features: np.ndarray) -> None:
        """The target verified the tokens at positions ``first`` .. ``first + n - 1`` of ``row`` and computed
        their ``features`` [n, F]: tokens fed at positions ``first + 1`` .. ``first + n`` carry them from now on."""
        features = np.asarray(features, dtype=np.float32)
        count = len(features)
        if not 0 <= first <= self._known[row] or features.shape[1:] != (self.feature_width,) or \
                first + count > self.spec.max_context:
            raise ValueError(f"target features for row {row} must continue the verified prefix (0 <= first "
                             f"<= {int(self._known[row])}, width {self.feature_width}); got first {first}, "
                             f"shape {features.shape}")
        self._target[row, first:first + count] = features
        self._known[row] = first + count
        # outputs for tokens before the newest verified one are never a parent again
        oldest = self._known[row] - 1
        self._memo[row] = {key: value for key, value in self._memo[row].items() if key[0] >= oldest}

    @property
    def fallbacks(self) -> int:
        return int(self._fallbacks[0])

    def known(self, row: int) -> int:
        """How many leading positions of ``row`` carry the target's features."""
        return int(self._known[row])

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray | None = None,
                logit_indices: np.ndarray | None = None) -> np.ndarray:
        batch, steps = input_ids.shape
        start = self.inner.lengths
        features = np.zeros((batch, steps, self.feature_width), dtype=np.float32)
        carried = np.zeros((batch, steps, self.hidden_size), dtype=np.float32)
        from_target = np.zeros((batch, steps), dtype=bool)
        paths = []
        for row in range(batch):
            # a path is kept from `offset` on: every key it is asked for starts at or after it (TokenPath.key)
            offset = max(0, min(int(start[row]), int(self._known[row])) - PATH_WINDOW)
            prefix = self._slots[row, offset:start[row]]
            row_paths = []
            for i in range(steps):
                path = TokenPath(offset, np.concatenate([prefix, self.visible(input_ids, tree_mask, row, i)]))
                position = int(position_ids[row, i])
                row_paths.append((position, path))
                from_target[row, i], vector = self._carried(row, position, path)
                (features if from_target[row, i] else carried)[row, i] = vector
            paths.append(row_paths)
        logits = self.inner.forward(input_ids, position_ids, tree_mask, logit_indices,
                                    extra={"features": features, "draft_hidden": carried, "from_target": from_target})
        hidden = self.inner.last_hidden
        for row in range(batch):
            for i, (position, path) in enumerate(paths[row]):
                self._memo[row][path.key(position)] = hidden[row, i].copy()
        self._record(input_ids, start)
        return logits

    def _carried(self, row: int, position: int, path: "TokenPath") -> tuple[bool, np.ndarray]:
        """(from the target?, the feature) for the token at ``position`` on ``path``: its parent's, else the
        nearest ancestor's that exists."""
        for parent in range(position - 1, -1, -1):
            if parent < self._known[row]:
                self._fallbacks[0] += parent != position - 1
                return True, self._target[row, parent]
            memo = self._memo[row].get(path.key(parent))
            if memo is not None:
                self._fallbacks[0] += parent != position - 1
                return False, memo
        return True, np.zeros(self.feature_width, dtype=np.float32)   # the first token: nothing before it


@dataclass(frozen=True, slots=True)
class TokenPath:
    """The tokens a new token sees, from position ``offset`` to its own (tokens[i] sits at offset + i)."""
    offset: int
    tokens: np.ndarray

    def key(self, position: int) -> tuple[int, bytes]:
        """The key of the token at ``position`` on this path: the position and the window of tokens up to it."""
        first = max(0, position + 1 - PATH_WINDOW - self.offset)
        return position, self.tokens[first:position + 1 - self.offset].tobytes()
