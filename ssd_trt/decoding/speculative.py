"""Standard speculative decoding: the draft proposes, the target verifies in one pass, alternating.

Chain (the default): K draft tokens, verified with :func:`sampling.verify_chain` (``rounds.py``).
Tree (``RuntimeOptions(tree_widths=...)``): ``decoding/speculative_tree.py``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ssd_trt.decoding.batch import Sequences, first_tokens
from ssd_trt.decoding.feature_relay import chain_features, hand_over, prompt_features
from ssd_trt.decoding.mode import Plan
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.rounds import verify_and_commit
from ssd_trt.decoding.sampling import TokenDistribution, filter_logits
from ssd_trt.decoding.speculative_tree import generate_tree_speculative, tree_nodes
from ssd_trt.decoding.stats import RoundStats
from ssd_trt.engines.base import Engine
from ssd_trt.engines.feature_draft import takes_target_features
from ssd_trt.engines.feeding import feed_ragged
from ssd_trt.engines.placement import ModelPlacement


@dataclass(frozen=True)
class SpeculativeSettings:
    draft_len: int                       # K (chain)
    tree_widths: tuple[int, ...] | None  # children per depth (tree verification), or None for a chain


class Speculative:
    """``--mode sd``."""
    name = "sd"
    roles = ("target", "draft")

    def plan(self, options, defaults) -> Plan:
        settings = SpeculativeSettings(options.draft_len or defaults.sd_draft_len, options.tree_widths)
        headroom = tree_nodes(list(settings.tree_widths)) if settings.tree_widths else settings.draft_len + 1
        return Plan(draft_len=settings.draft_len, headroom=headroom, settings=settings)

    def run(self, engines: Mapping[str, Engine], prompts: list[list[int]], seqs: Sequences,
            rng: np.random.Generator, plan: Plan, placements: Mapping[str, ModelPlacement]) -> dict:
        settings = plan.settings
        if settings.tree_widths:
            return generate_tree_speculative(engines["target"], engines["draft"], prompts, seqs, rng,
                                             list(settings.tree_widths))
        return generate_speculative(engines["target"], engines["draft"], prompts, seqs, rng, settings.draft_len)


def draft_chain(draft, pending: list[list[int]], num_tokens: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[np.ndarray, list[TokenDistribution] | None]:
    """Feed each row's pending tokens, then draft ``num_tokens`` more. Returns tokens [B,K] and, when
    sampling, each row's K distributions the tokens were drawn from (every row drawn at once per step).

    The last drafted token is not fed (the target verifies it first), so after this the draft's cache
    holds the pending tokens plus s_1..s_{K-1}.
    """
    batch = len(pending)
    tokens = np.zeros((batch, num_tokens), dtype=np.int64)
    step_dists: list[TokenDistribution] = []
    logits = feed_ragged(draft, pending)
    for i in range(num_tokens):
        if params.greedy:
            tokens[:, i] = np.argmax(logits, axis=-1)
        else:
            q = filter_logits(logits, params)
            tokens[:, i] = q.sample(rng)
            step_dists.append(q)
        if i + 1 < num_tokens:
            logits = draft.forward(tokens[:, i:i + 1], draft.lengths[:, None].astype(np.int64))[:, 0]
    if params.greedy:
        return tokens, None
    dists = TokenDistribution.stack(step_dists, draft.spec.vocab_size)          # [K, B]
    return tokens, [dists[:, row] for row in range(batch)]


def generate_speculative(target: Engine, draft: Engine, prompts: list[list[int]], seqs: Sequences,
                         rng: np.random.Generator, draft_len: int = 4) -> dict:
    """Chain rounds until every row is done: draft K, verify K+1 positions, keep the draft's cache in step."""
    batch = len(prompts)
    stats = RoundStats(mode="sd", draft_len=draft_len)
    draft.reset(batch)
    bonus = first_tokens(target, prompts, seqs, rng)
    hand_over(draft, prompt_features(target, draft, prompts))   # a feature draft reads them (no-op otherwise)
    refeed_verified = takes_target_features(draft)
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
