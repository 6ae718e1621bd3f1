"""The sampling filters written the plain way: dense float64 vectors, one row at a time, no shortcuts.

This is the specification the fast, sparse, batched ``ssd_trt.decoding.sampling.filter_logits`` is
checked against (it is the project's earlier implementation, kept here as the reference).
"""
from __future__ import annotations

import numpy as np

from ssd_trt.decoding.params import SamplingParams


def reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """softmax(logits / T) restricted to top-k (ties at the k-th kept) and the top-p nucleus. [..., V]."""
    z = np.asarray(logits, dtype=np.float64) / max(params.temperature, 1e-8)
    vocab = z.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(z, vocab - params.top_k, axis=-1)[..., vocab - params.top_k, None]
        z = np.where(z >= kth, z, -np.inf)
    z = z - z.max(axis=-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep = np.zeros(probs.shape, dtype=bool)
        np.put_along_axis(keep, order, before < params.top_p, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def reference_saguaro(probs: np.ndarray, fan_out: int, downweight: float) -> np.ndarray:
    """sigma_{F,C}: the top-F tokens of ``probs`` [V] get C times their mass, renormalised."""
    if fan_out <= 0 or downweight == 1.0:
        return probs
    top = np.argsort(-probs, kind="stable")[:fan_out]
    scaled = probs.copy()
    scaled[top] *= downweight
    return scaled / scaled.sum()
