"""Standard speculative decoding: the draft proposes, the target verifies in one pass, alternating.

Chain (the default): K draft tokens (:func:`draft_tokens`), verified with :func:`sampling.verify_chain`.
Tree (``SD(tree_widths=...)``): ``decoding/speculative_tree.py``. The engine step runs both
(``batching/round.py``).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ssd_trt.decoding.mode import ResolvedMode
from ssd_trt.decoding.sampling import TokenDistribution
from ssd_trt.decoding.speculative_tree import tree_nodes
from ssd_trt.engines.feeding import feed_ragged


class Speculative:
    """``--mode sd`` (settings: ``decoding/settings.SD``)."""
    name = "sd"
    roles = ("target", "draft")

    def resolve(self, settings, defaults) -> ResolvedMode:
        settings = settings.resolved(defaults)
        if settings.tree_widths:     # a tree's depth is the most a round can accept: its K
            widths = list(settings.tree_widths)
            return ResolvedMode(self.name, settings, draft_len=len(widths), headroom=tree_nodes(widths))
        return ResolvedMode(self.name, settings, draft_len=settings.draft_len, headroom=settings.draft_len + 1)


Draw = Callable[[np.ndarray, int], tuple[np.ndarray, "TokenDistribution | None"]]


def draft_tokens(draft, pending: list[list[int]], num_tokens: int, draw: Draw
                 ) -> tuple[np.ndarray, list[TokenDistribution] | None]:
    """The one draft loop (SD's chain, SSD's just-in-time backup): feed each row's pending tokens, then draft
    ``num_tokens`` more, the i-th of every row at once by ``draw(logits [B, V], i) -> (tokens [B], q or None)``.
    Returns tokens [B, K] and, when the draws were sampled, each row's K distributions they were drawn from.

    The last drafted token is not fed (the target verifies it first), so after this the draft's cache
    holds the pending tokens plus s_1..s_{K-1}.
    """
    batch = len(pending)
    tokens = np.zeros((batch, num_tokens), dtype=np.int64)
    step_dists: list[TokenDistribution] = []
    logits = feed_ragged(draft, pending)
    for i in range(num_tokens):
        tokens[:, i], q = draw(logits, i)
        if q is not None:
            step_dists.append(q)
        if i + 1 < num_tokens:
            logits = draft.forward(tokens[:, i:i + 1], draft.lengths[:, None].astype(np.int64))[:, 0]
    if not step_dists:
        return tokens, None
    dists = TokenDistribution.stack(step_dists, draft.spec.vocab_size)          # [K, B]
    return tokens, [dists[:, row] for row in range(batch)]


SPECULATIVE = Speculative()
