"""Plain autoregressive decoding: one target forward per token. The exactness baseline."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ssd_trt.decoding.batch import Sequences, first_tokens
from ssd_trt.decoding.mode import ResolvedMode
from ssd_trt.decoding.sampling import next_tokens
from ssd_trt.engines.base import Engine
from ssd_trt.engines.placement import ModelPlacement


class Autoregressive:
    """``--mode ar``."""
    name = "ar"
    roles = ("target",)

    def resolve(self, settings, defaults) -> ResolvedMode:
        return ResolvedMode(self.name, settings, draft_len=None, headroom=0)

    def run(self, engines: Mapping[str, Engine], prompts: list[list[int]], seqs: Sequences,
            rng: np.random.Generator, resolved: ResolvedMode, placements: Mapping[str, ModelPlacement]) -> dict:
        return generate_autoregressive(engines["target"], prompts, seqs, rng)


def generate_autoregressive(target: Engine, prompts: list[list[int]], seqs: Sequences,
                            rng: np.random.Generator) -> dict:
    continue_autoregressive(target, seqs, first_tokens(target, prompts, seqs, rng), rng)
    return {"mode": "ar", "target_forwards": None, "mean_accepted": None, "acceptance_rate": None,
            "cache_hit_rate": None}


def continue_autoregressive(target: Engine, seqs: Sequences, unfed: list[int], rng: np.random.Generator) -> None:
    """Decode until every row is done; ``unfed`` is each row's committed token not yet in the cache."""
    step = np.array(unfed, dtype=np.int64)
    while not seqs.all_done:
        logits = target.forward(step[:, None], target.lengths[:, None].astype(np.int64))[:, 0]
        step = next_tokens(logits, seqs.params, rng)
        for row, token in enumerate(step):
            seqs.commit(row, [int(token)])


AUTOREGRESSIVE = Autoregressive()
