"""``ssd::tree_attention`` as a torch custom op, so the model traces to one ONNX node per layer.

The eager implementation is the reference math in ``plugins/tree_attention/reference.py``; the
exporters replace the op by a custom-domain node (see ``ssd_trt.export``).
"""
from __future__ import annotations

import torch

from ssd_trt_plugins.tree_attention.reference import tree_attention_reference

OP_NAMESPACE = "ssd"
OP_NAME = "tree_attention"


@torch.library.custom_op(f"{OP_NAMESPACE}::{OP_NAME}", mutates_args=())
def tree_attention(query: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, cache_lengths: torch.Tensor,
                   tree_mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    output, keys, values = tree_attention_reference(query, key_new, value_new, key_cache, value_cache,
                                                    cache_lengths, tree_mask, scale)
    return output, keys, values


@tree_attention.register_fake
def _(query, key_new, value_new, key_cache, value_cache, cache_lengths, tree_mask, scale):
    return torch.empty_like(query), torch.empty_like(key_cache), torch.empty_like(value_cache)
