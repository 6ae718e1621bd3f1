"""What every speculative round shares: the target verifies each row's speculation in one pass, and the
accepted tokens plus the bonus token are committed (SD and SSD alike)."""
from __future__ import annotations

import numpy as np

from ssd_trt.decoding.batch import Sequences
from ssd_trt.decoding.sampling import Outcome, TokenDistribution, verify_chain
from ssd_trt.decoding.stats import RoundStats
from ssd_trt.engines.base import Engine


def verify_and_commit(target: Engine, bonus: list[int], tokens: np.ndarray,
                      dists: list[TokenDistribution] | None, seqs: Sequences, rng: np.random.Generator,
                      stats: RoundStats) -> list[Outcome | None]:
    """Score [t*_prev, s_1..s_K] per row in one target pass, verify (``sampling.verify_chain``), commit
    s_1..s_k + t*, and roll the target's cache back to the verified prefix (the prefix, t*_prev, s_1..s_k).

    Rows already done are not verified: their outcome is None and nothing of theirs grows.
    """
    batch, draft_len = tokens.shape
    start = target.lengths
    feed = np.concatenate([np.asarray(bonus, dtype=np.int64)[:, None], tokens], axis=1)
    logits = target.forward(feed, start[:, None] + np.arange(draft_len + 1)[None, :])
    outcomes: list[Outcome | None] = []
    new_lengths = start.copy()
    for row in range(batch):
        if seqs.done[row]:
            outcomes.append(None)
            continue
        outcome = verify_chain(tokens[row], None if dists is None else dists[row], logits[row], seqs.params, rng)
        seqs.commit(row, [int(t) for t in tokens[row, :outcome.accepted]] + [outcome.bonus])
        stats.record_round(outcome.accepted)
        new_lengths[row] = start[row] + 1 + outcome.accepted
        outcomes.append(outcome)
    target.rollback(new_lengths)
    return outcomes
