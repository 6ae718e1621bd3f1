"""The draft's copy component: its distribution mixed with "what followed this n-gram before".

A small draft cannot learn to retrieve spans from its context (summaries, quoted code, repeated
names), which is where the target is most predictable. So the draft model used for speculation is

    q'(v) = (1 - lam_n) q(v) + lam_n [v == f]

with q the neural draft's distribution, f the token that followed the most recent earlier occurrence
of the longest suffix of the sequence (n tokens, n <= max_ngram; prompt lookup, ``ngram.longest_match``)
and lam_n a weight per match length, fitted on held-out distillation data (``distill/copy_fit.py``;
lam = 0 where no suffix recurs). This is a pointer-generator mixture (See et al. 2017, arXiv
1704.04368) with a gate that reads only the match length.

Lossless by construction: q' is a distribution, and every strategy samples from and divides by the
same logits this engine returns, so the acceptance rule sees the q' it drew from.

In logit space (softmax is shift-invariant, so only f's logit moves): with Z = sum_v exp(l_v),
q'(v) is proportional to exp(l_v) + [v == f] * lam/(1 - lam) * Z, i.e.
l'_f = logaddexp(l_f, log(lam/(1 - lam)) + logsumexp(l)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ssd_trt.engines.base import all_indices
from ssd_trt.engines.token_mirror import TokenMirrorEngine
from ssd_trt.errors import ArtifactError
from ssd_trt.ngram import longest_match


@dataclass(frozen=True, slots=True)
class CopyMixture:
    """``weights[n - 1]`` is lam for a longest match of n tokens; matches are looked up to len(weights)."""
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.weights or not all(isinstance(w, (int, float)) and 0.0 <= w < 1.0 for w in self.weights):
            raise ValueError(f"copy_mixture weights must be a non-empty list of numbers in [0, 1), got "
                             f"{list(self.weights)!r}")

    @property
    def max_ngram(self) -> int:
        return len(self.weights)

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str) -> "CopyMixture | None":
        """The ``copy_mixture`` entry of a draft's config.json (None when absent)."""
        entry = config.get("copy_mixture")
        if entry is None:
            return None
        try:
            return cls(tuple(entry["weights"]))
        except (TypeError, KeyError, ValueError) as exc:
            raise ArtifactError(f"{where}: copy_mixture must look like {{\"weights\": [lam_1, ..., lam_N]}} "
                                f"with each lam in [0, 1) ({exc}); refit it with `python -m ssd_trt.distill "
                                f"--fit-copy-only DRAFT_DIR ...` or delete the entry") from None

    def as_config(self) -> dict[str, Any]:
        return {"weights": [round(float(w), 4) for w in self.weights]}

    def apply(self, logits: np.ndarray, context: np.ndarray) -> np.ndarray:
        """q' logits for the token after ``context`` (1-D ids), from the draft's logits [V] (in place)."""
        match = longest_match(context, self.max_ngram)
        if match is None:
            return logits
        follower, size = match
        weight = self.weights[size - 1]
        if weight <= 0.0:
            return logits
        top = float(np.max(logits))
        if not np.isfinite(top):          # a broken row (NaN / +inf) stays as the engine returned it
            return logits
        log_z = top + float(np.log(np.sum(np.exp(logits - top))))
        logits[follower] = np.logaddexp(logits[follower], np.log(weight / (1.0 - weight)) + log_z)
        return logits

    def apply_teacher_forced(self, logits: np.ndarray, ids: Sequence[int], first: int) -> np.ndarray:
        """Row t of ``logits`` [T, V] predicts the token after ids[:first + t + 1] (in place)."""
        array = np.asarray(ids, dtype=np.int64)
        for t in range(logits.shape[0]):
            self.apply(logits[t], array[:first + t + 1])
        return logits


class CopyMixtureEngine(TokenMirrorEngine):
    """A draft engine whose logits are q' (see the module doc). Wraps any backend engine; the context of
    each new token comes from the mirrored cache (:class:`~ssd_trt.engines.token_mirror.TokenMirrorEngine`)
    plus, in a tree step, its ancestors under ``tree_mask``."""

    def __init__(self, inner, mixture: CopyMixture) -> None:
        super().__init__(inner)
        self.mixture = mixture

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray | None = None,
                logit_indices: np.ndarray | None = None) -> np.ndarray:
        start = self.inner.lengths
        logits = self.inner.forward(input_ids, position_ids, tree_mask, logit_indices)
        batch, steps = input_ids.shape
        indices = all_indices(batch, steps) if logit_indices is None else np.asarray(logit_indices)
        if logits.shape[:2] != indices.shape:   # malformed: left for the strategy's checks to report
            return logits
        if not logits.flags.writeable:
            logits = logits.copy()
        for row in range(batch):
            prefix = self._slots[row, :start[row]]
            for column, i in enumerate(indices[row]):       # only the tokens whose logits are read
                self.mixture.apply(logits[row, column],
                                   np.concatenate([prefix, self.visible(input_ids, tree_mask, row, i)]))
        self._record(input_ids, start)
        return logits
