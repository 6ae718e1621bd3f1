"""The ``ssd::tree_attention`` operator: one attention op for prefill, decode, chain and tree steps."""
from plugins.tree_attention.reference import pack_tree_mask, tree_attention_reference, unpack_tree_mask

__all__ = ["pack_tree_mask", "tree_attention_reference", "unpack_tree_mask"]
