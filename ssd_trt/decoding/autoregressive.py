"""Plain autoregressive decoding: one target forward per token. The exactness baseline."""
from __future__ import annotations

import numpy as np

from ssd_trt.decoding.batch import Sequences, prefill
from ssd_trt.decoding.sampling import next_token


def generate_autoregressive(target, prompts: list[list[int]], seqs: Sequences,
                            rng: np.random.Generator) -> dict:
    target.reset(len(prompts))
    logits = prefill(target, prompts)
    while True:
        step = np.array([next_token(logits[row], seqs.params, rng) for row in range(len(prompts))])
        for row, token in enumerate(step):
            seqs.commit(row, [int(token)])
        if seqs.all_done:
            break
        lengths = target.lengths
        logits = target.forward(step[:, None], lengths[:, None].astype(np.int64))[:, 0]
    return {"mode": "ar", "target_forwards": None, "mean_accepted": None, "acceptance_rate": None,
            "cache_hit_rate": None}
