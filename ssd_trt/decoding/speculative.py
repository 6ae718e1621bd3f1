"""Standard speculative decoding: the draft proposes, the target verifies in one pass, alternating.

Chain (the default): K draft tokens, verified with :func:`sampling.verify_chain` (``rounds.py``).
Tree (``SD(tree_widths=...)``): ``decoding/speculative_tree.py``.
"""
from __future__ import annotations

import time
from typing import Callable, Mapping

import numpy as np

from ssd_trt.decoding.batch import Sequences, first_tokens
from ssd_trt.decoding.feature_relay import chain_features, hand_over, prompt_features
from ssd_trt.decoding.mode import ResolvedMode
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.rounds import verify_and_commit
from ssd_trt.decoding.sampling import TokenDistribution, filter_logits
from ssd_trt.decoding.speculative_tree import generate_tree_speculative, tree_nodes
from ssd_trt.decoding.stats import RoundStats
from ssd_trt.engines.base import Engine
from ssd_trt.engines.feeding import feed_ragged
from ssd_trt.engines.placement import ModelPlacement


class Speculative:
    """``--mode sd`` (settings: ``decoding/settings.SD``)."""
    name = "sd"
    roles = ("target", "draft")

    def resolve(self, settings, defaults) -> ResolvedMode:
        settings = settings.resolved(defaults)
        headroom = tree_nodes(list(settings.tree_widths)) if settings.tree_widths else settings.draft_len + 1
        return ResolvedMode(self.name, settings, draft_len=settings.draft_len, headroom=headroom)

    def run(self, engines: Mapping[str, Engine], prompts: list[list[int]], seqs: Sequences,
            rng: np.random.Generator, resolved: ResolvedMode, placements: Mapping[str, ModelPlacement]) -> dict:
        settings = resolved.settings
        if settings.tree_widths:
            return generate_tree_speculative(engines["target"], engines["draft"], prompts, seqs, rng,
                                             list(settings.tree_widths))
        return generate_speculative(engines["target"], engines["draft"], prompts, seqs, rng, settings.draft_len)


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


def draft_chain(draft, pending: list[list[int]], num_tokens: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[np.ndarray, list[TokenDistribution] | None]:
    """SD's draft: :func:`draft_tokens` with the plain draws (argmax, or a draw from the filtered q)."""
    def draw(logits: np.ndarray, _: int) -> tuple[np.ndarray, TokenDistribution | None]:
        if params.greedy:
            return np.argmax(logits, axis=-1), None
        q = filter_logits(logits, params)
        return q.sample(rng), q
    return draft_tokens(draft, pending, num_tokens, draw)


def generate_speculative(target: Engine, draft: Engine, prompts: list[list[int]], seqs: Sequences,
                         rng: np.random.Generator, draft_len: int = 4) -> dict:
    """Chain rounds until every row is done: draft K, verify K+1 positions, keep the draft's cache in step."""
    batch = len(prompts)
    stats = RoundStats(mode="sd", draft_len=draft_len)
    draft.reset(batch)
    bonus = first_tokens(target, prompts, seqs, rng)
    hand_over(draft, prompt_features(target, draft, prompts))   # a feature draft reads them (no-op otherwise)
    refeed_verified = draft.takes_target_features
    pending = [list(p) + [b] for p, b in zip(prompts, bonus)]   # tokens the draft has not seen yet
    while not seqs.all_done:
        t0 = time.perf_counter()
        draft_start = draft.lengths
        tokens, dists = draft_chain(draft, pending, draft_len, seqs.params, rng)
        draft_fed = draft.lengths - draft_start
        t1 = time.perf_counter()
        outcomes = verify_and_commit(target, bonus, tokens, dists, seqs, rng, stats)
        hand_over(draft, chain_features(target, draft, outcomes))
        t2 = time.perf_counter()
        new_draft = draft_start.copy()
        for row, outcome in enumerate(outcomes):
            if outcome is None:          # finished rows idle: nothing kept, nothing grows
                pending[row] = [bonus[row]]
                continue
            # the draft fed pending + s_1..s_{K-1}; keep pending + s_1..s_k (s_K was never fed). A feature
            # draft keeps none of them: it fed s_i with its own features, and a verified token is fed again
            # carrying the target's (engines/feature_draft.py)
            fed_pending = int(draft_fed[row]) - (draft_len - 1)
            kept = 0 if refeed_verified else min(outcome.accepted, draft_len - 1)
            new_draft[row] = draft_start[row] + fed_pending + kept
            pending[row] = [int(t) for t in tokens[row, kept:outcome.accepted]] + [outcome.bonus]
            bonus[row] = outcome.bonus
        draft.rollback(new_draft)
        stats.add_time(draft_s=t1 - t0, verify_s=t2 - t1)
    return stats.summary()


SPECULATIVE = Speculative()
