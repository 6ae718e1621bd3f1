"""Tree masks of ``ssd::tree_attention`` (reference.py has the operator's contract): a boolean [T, T] mask packed
into int32 words, bit j of row i set when new token i may attend to new token j. Plain numpy, so the runtime's
CPU path imports it without torch."""
from __future__ import annotations

import numpy as np

MASK_WORD_BITS = 32


def mask_words(num_new_tokens: int) -> int:
    """Number of int32 words that hold one mask row of ``num_new_tokens`` bits."""
    return (num_new_tokens + MASK_WORD_BITS - 1) // MASK_WORD_BITS


def pack_tree_mask(mask: np.ndarray) -> np.ndarray:
    """Pack a boolean mask [..., T, T] into int32 words [..., T, ceil(T/32)] (bit j = column j)."""
    mask = np.asarray(mask, dtype=bool)
    num_new = mask.shape[-1]
    words = mask_words(num_new)
    padded = np.zeros(mask.shape[:-1] + (words * MASK_WORD_BITS,), dtype=bool)
    padded[..., :num_new] = mask
    as_bytes = np.packbits(padded, axis=-1, bitorder="little")  # 4 bytes per word, little-endian
    return np.ascontiguousarray(as_bytes).view("<i4").astype(np.int32, copy=False)


def causal_tree_mask(batch: int, num_new_tokens: int) -> np.ndarray:
    """The chain case: token i sees new tokens 0..i. Packed int32 [batch, T, W]."""
    lower = np.tril(np.ones((num_new_tokens, num_new_tokens), dtype=bool))
    return np.broadcast_to(pack_tree_mask(lower), (batch, num_new_tokens, mask_words(num_new_tokens))).copy()
