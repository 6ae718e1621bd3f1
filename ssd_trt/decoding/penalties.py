"""Logit adjustments a request asks for (logit bias, repetition / frequency / presence penalties), applied to the
target's logits at every position before any decision on them: the greedy argmax, a draw, a verification.

Speculative decoding stays lossless with them because verification adjusts each position by the history *at that
position*: the request's tokens plus the drafted tokens ahead of it on the path being verified (a chain's first k, a
tree node's ancestors). Position k of a verification then sees exactly the logits AR would have seen had it emitted
those tokens, so accepting or rejecting against them gives AR's distribution. The draft's own proposals are not
adjusted: any proposal distribution q is exact under verification (``sampling.py``); q further from the adjusted p
only costs acceptance.

Definitions and order, as vLLM's sampler applies them (OpenAI's API reference for the first two):

1. ``logit_bias``: z_t += b_t;
2. ``repetition_penalty`` r (Keskar et al. 2019, "CTRL", sec. 4.1; over the prompt and the output, as vLLM): for
   every token t seen, z_t / r when z_t > 0, else z_t * r;
3. ``frequency_penalty`` and ``presence_penalty``: z_t -= c_t * frequency + [c_t > 0] * presence, where c_t counts
   t in the output so far.

Temperature, top-k, top-p and ``min_p`` then filter the adjusted logits (``sampling.filter_logits``). The logprobs a
request gets are of the raw logits (``logprobs.py``), before any of this.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.speculative_tree import node_path


def adjusts(params: SamplingParams) -> bool:
    """Whether the request changes the target's logits at all (if not, nothing here runs)."""
    return bool(params.logit_bias) or params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 \
        or params.presence_penalty != 0.0


def adjusted(logits: np.ndarray, params: SamplingParams, prompt: Sequence[int],
             outputs: Sequence[Sequence[int]]) -> np.ndarray:
    """``logits`` [N, V] of N positions of one request, adjusted; ``outputs[j]``: the tokens generated before
    position j (the request's, then any drafted ones ahead of it)."""
    z = np.array(logits, dtype=np.float32)
    vocab = z.shape[-1]
    for token, bias in params.logit_bias:
        if 0 <= token < vocab:
            z[:, token] += bias
    prompt_seen = np.zeros(vocab, dtype=bool)
    if params.repetition_penalty != 1.0:
        prompt_seen[np.asarray(prompt, dtype=np.int64)] = True
    for row, output in enumerate(outputs):
        counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=vocab)[:vocab]
        if params.repetition_penalty != 1.0:
            seen = prompt_seen | (counts > 0)
            r = params.repetition_penalty
            z[row] = np.where(seen, np.where(z[row] > 0, z[row] / r, z[row] * r), z[row])
        if params.frequency_penalty or params.presence_penalty:
            z[row] -= counts * params.frequency_penalty + (counts > 0) * params.presence_penalty
    return z


def chain_outputs(tokens: Sequence[int], drafted: Sequence[int]) -> list[list[int]]:
    """The output history at each of a chain's K + 1 verified positions: position k follows the first k drafted."""
    return [list(tokens) + list(drafted[:k]) for k in range(len(drafted) + 1)]


def tree_outputs(tokens: Sequence[int], nodes: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """The output history at each node of a token tree (node 0, the root, is the last committed token): a node's
    position follows its ancestors below the root and itself."""
    return [list(tokens) + node_path(nodes, parents, node) for node in range(len(parents))]
