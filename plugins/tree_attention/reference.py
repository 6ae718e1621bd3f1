"""Reference semantics of ``ssd::tree_attention`` (the contract every implementation matches).

Inputs (B batch, T new tokens, S cache capacity, Hq query heads, Hkv kv heads, D head dim):
  query       [B, Hq,  T, D]  float   rotary embedding already applied
  key_new     [B, Hkv, T, D]  float   rotary embedding already applied
  value_new   [B, Hkv, T, D]  float
  key_cache   [B, Hkv, S, D]  float
  value_cache [B, Hkv, S, D]  float
  cache_lengths [B] int32     valid prefix length L_b of each sequence's cache
  tree_mask   [B, T, W] int32, W = ceil(T / 32): bit j of row i (word j // 32, bit j % 32,
              little-endian within the word) says new token i may attend to new token j.
  scale       float attribute (usually D ** -0.5)

Semantics, per sequence b:
  1. the new keys/values are written into the cache at slots L_b .. L_b + T - 1 (requires L_b + T <= S);
  2. query i attends to every cached slot s < L_b and to new token j (slot L_b + j) when bit (i, j)
     is set; query head h reads kv head h // (Hq // Hkv) (grouped-query attention);
  3. softmax(scale * q.k) over the allowed slots, weighted sum of the values.
Outputs: attention output [B, Hq, T, D] and the updated key/value caches (same shape as the inputs).

A causal mask over the new tokens is the chain case (prefill, decode, chain verification); a tree
mask lets sibling branches share one forward pass. The caller guarantees bit (i, i) is set, so no row
is empty.
"""
from __future__ import annotations

import torch

# the numpy half of the contract (packing masks), kept apart so the runtime imports it without torch
from ssd_trt_plugins.tree_attention.masks import MASK_WORD_BITS, causal_tree_mask, mask_words, pack_tree_mask  # noqa: F401


def unpack_tree_mask(packed: torch.Tensor, num_new_tokens: int) -> torch.Tensor:
    """Inverse of :func:`pack_tree_mask` for torch tensors: int32 [..., T, W] -> bool [..., T, T]."""
    bit_index = torch.arange(num_new_tokens, device=packed.device)
    words = packed.to(torch.int64)[..., bit_index // MASK_WORD_BITS]  # [..., T, T]
    return ((words >> (bit_index % MASK_WORD_BITS)) & 1).bool()


def attention_mask(cache_lengths: torch.Tensor, tree_mask: torch.Tensor, num_new_tokens: int,
                   capacity: int) -> torch.Tensor:
    """Boolean [B, T, S] mask of the cache slots each new token may read (after the write)."""
    slots = torch.arange(capacity, device=cache_lengths.device)
    relative = slots[None, :] - cache_lengths.to(torch.int64)[:, None]  # [B, S]
    in_prefix = relative < 0
    in_new = (relative >= 0) & (relative < num_new_tokens)
    new_bits = unpack_tree_mask(tree_mask, num_new_tokens)  # [B, T, T]
    gathered = torch.gather(new_bits, 2, relative.clamp(0, num_new_tokens - 1)[:, None, :]
                            .expand(-1, num_new_tokens, -1))  # [B, T, S]
    return in_prefix[:, None, :] | (in_new[:, None, :] & gathered)


def write_new_kv(cache: torch.Tensor, new: torch.Tensor, cache_lengths: torch.Tensor) -> torch.Tensor:
    """Return ``cache`` with ``new`` [B,H,T,D] written at slots L_b .. L_b+T-1 (functional)."""
    batch, heads, num_new, dim = new.shape
    slot = cache_lengths.to(torch.int64)[:, None] + torch.arange(num_new, device=new.device)[None, :]
    index = slot[:, None, :, None].expand(batch, heads, num_new, dim)
    return cache.scatter(2, index, new)


def tree_attention_reference(query: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor,
                             key_cache: torch.Tensor, value_cache: torch.Tensor,
                             cache_lengths: torch.Tensor, tree_mask: torch.Tensor,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch implementation of the contract above (fp32 accumulation)."""
    batch, q_heads, num_new, dim = query.shape
    kv_heads, capacity = key_cache.shape[1], key_cache.shape[2]
    key_cache = write_new_kv(key_cache, key_new, cache_lengths)
    value_cache = write_new_kv(value_cache, value_new, cache_lengths)
    group = q_heads // kv_heads
    keys = key_cache.repeat_interleave(group, dim=1).float()
    values = value_cache.repeat_interleave(group, dim=1).float()
    scores = torch.matmul(query.float(), keys.transpose(-1, -2)) * scale  # [B, Hq, T, S]
    allowed = attention_mask(cache_lengths, tree_mask, num_new, capacity)[:, None, :, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    output = torch.matmul(torch.softmax(scores, dim=-1), values).to(query.dtype)
    return output, key_cache, value_cache
