"""The target's log-probabilities of the tokens a request emits (and of its prompt's tokens), when it asks for them.

They are the target model's own distribution at each position: the log-softmax of its raw logits, before temperature,
top-p / top-k and any other processing (vLLM's default, ``logprobs_mode="raw_logprobs"``; OpenAI's are of the model's
distribution too). So they do not depend on the decoding mode: a token the draft proposed and the target accepted gets
the target's logprob at that position, computed from the same verification forward that accepted it, never the
draft's. Greedy requests (temperature 0) get meaningful numbers this way, where a temperature-scaled distribution
would be degenerate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

MAX_TOP_LOGPROBS = 20          # alternatives per position, as OpenAI's top_logprobs (0..20)


@dataclass(frozen=True)
class TokenLogprob:
    """A token, its log-probability, and the ``top`` most likely tokens at its position (most likely first)."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """``logits`` [N, V]: the target's logits at the positions that predicted ``tokens`` [N] (row j predicted token j);
    each token's logprob and the ``top`` most likely alternatives there."""
    z = np.asarray(logits, dtype=np.float64)
    peak = z.max(axis=-1, keepdims=True)
    logp = z - (peak + np.log(np.exp(z - peak).sum(axis=-1, keepdims=True)))      # log-softmax, stable
    out = []
    for row, token in enumerate(tokens):
        alternatives: tuple[tuple[int, float], ...] = ()
        if top > 0:
            best = np.argpartition(-logp[row], top - 1)[:top]
            best = best[np.argsort(-logp[row, best], kind="stable")]
            alternatives = tuple((int(t), float(logp[row, t])) for t in best)
        out.append(TokenLogprob(int(token), float(logp[row, int(token)]), alternatives))
    return out
