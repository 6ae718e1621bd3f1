"""Standard speculative decoding: the draft proposes, the target verifies in one pass, alternating.

Chain (the default): K draft tokens per row (:func:`draft_chains`, over :func:`draft_tokens`, the one draft loop SSD's
just-in-time backup uses too), verified with :func:`sampling.verify_chain`. Tree (``SD(tree_widths=...)``):
``decoding/speculative_tree.py``. The engine step's round runs both (``decoding/round.py``).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ssd_trt.decoding.grammar import DraftGrammar, mask_rows
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.sampling import TokenDistribution, draw_rows
from ssd_trt.engines.feeding import feed_ragged

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


def draft_chains(draft, pending: list[list[int]], draft_lens: Sequence[int], params: Sequence[SamplingParams],
                 rngs: Sequence[np.random.Generator], wanted: Sequence[bool],
                 grammars: Sequence[DraftGrammar | None] | None = None) -> tuple[np.ndarray, list | None]:
    """SD's proposals for the rows of a draft view: feed each row's pending tokens (its bonus token last), then draft
    max(K) tokens, row r's first ``draft_lens[r]`` drawn by its own parameters and stream (the rest, and every token
    of a row not ``wanted``, the argmax: never drawn, never verified), masked by the row's grammar along its chain
    (``grammars``: the draft's copies, ``grammar.py``). Tokens [B, K_max] and, when any wanted row samples, every
    row's K_max distributions (a greedy row's: point masses)."""
    sampled = any(not p.greedy for p, w in zip(params, wanted) if w)

    def draw(logits: np.ndarray, i: int):
        tokens, q = draw_rows(logits, params, rngs, [w and i < k for w, k in zip(wanted, draft_lens)])
        return tokens, (TokenDistribution.point_mass(tokens) if q is None and sampled else q)
    most = max(k for k, w in zip(draft_lens, wanted) if w)
    tokens, dists = draft_tokens(draft, pending, most, masked_draws(draw, grammars))
    validate_tokens(tokens, (len(pending), most), draft.spec.vocab_size, "a chain")
    return tokens, dists


def masked_draws(draw: Draw, grammars: Sequence[DraftGrammar | None] | None) -> Draw:
    """``draw`` for :func:`draft_tokens`, on logits masked by each row's grammar (the draft's copies, each advanced
    along the tokens its row drew before: a chain); ``draw`` itself when no row has one."""
    if not grammars or all(g is None for g in grammars):
        return draw
    drawn: list[np.ndarray] = []          # the tokens drawn at the step before

    def masked(logits: np.ndarray, i: int):
        logits = mask_rows(logits, [None if g is None else g.mask_after(int(drawn[0][r]) if drawn else None)
                                    for r, g in enumerate(grammars)])
        tokens, q = draw(logits, i)
        drawn[:] = [tokens]
        return tokens, q
    return masked


def validate_tokens(tokens: np.ndarray, shape: tuple[int, ...], vocab: int, what: str) -> None:
    """Refuse drafted tokens of the wrong shape or outside the vocabulary (garbage from the draft is a draft failure,
    never an output)."""
    tokens = np.asarray(tokens)
    if tokens.shape != shape or (tokens.size and (tokens.min() < 0 or tokens.max() >= vocab)):
        raise ValueError(f"draft returned a malformed speculation in {what} (shape {tokens.shape}, expected {shape}, "
                         f"tokens within 0..{vocab - 1})")
