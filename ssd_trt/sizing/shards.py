"""The parameters each tensor-parallel rank of the target holds, projection by projection.

The split itself -- Megatron-LM's (Shoeybi et al. 2019, section 3): heads and MLP columns, KV heads replicated
when there are fewer than ranks, as vLLM does; embedding, norms and LM head whole on every rank -- is
``models/sharding.py``'s table, the one the export and the runtime slice with. Here it is counted: which
projections a rank holds and their shapes (block formats need each one's in_features), without reading a weight.
"""
from __future__ import annotations

from dataclasses import dataclass

from ssd_trt.models.sharding import PROJECTIONS, Split


def describe(split: Split) -> str:
    """What one rank of ``split`` holds, in words."""
    c = split.config
    if split.ranks == 1:
        return f"whole: {c.num_heads} heads, {c.num_kv_heads} KV heads, {c.intermediate_size} MLP columns"
    kv = (f"{split.kv_heads}/{c.num_kv_heads} KV heads" if split.kv_replicas == 1 else
          f"1 KV head (each of {c.num_kv_heads} on {split.kv_replicas} ranks)")
    return (f"{split.heads}/{c.num_heads} heads, {kv}, {split.intermediate}/{c.intermediate_size} MLP columns, "
            "embedding and head whole")


@dataclass(frozen=True, slots=True)
class Projection:
    """One linear layer's weight on a rank: y = x W with W [in_features, out_features]."""
    name: str
    in_features: int
    out_features: int

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True, slots=True)
class RankParams:
    """The parameters one rank holds: the layers' projections (one layer's list, ``layers`` times), the small float
    tensors (norms, biases), and the replicated embedding and LM head."""
    layers: int
    projections: tuple[Projection, ...]
    small: int              # norms, q/k norms, attention biases: all layers and the final norm
    embedding: int          # vocab x hidden
    head: int               # head rows x hidden
    tied: bool              # the checkpoint's head is its embedding

    @property
    def linear(self) -> int:
        return self.layers * sum(p.numel for p in self.projections)

    @property
    def total(self) -> int:
        """Parameters as the checkpoint counts them (a tied head is the embedding, counted once)."""
        return self.linear + self.small + self.embedding + (0 if self.tied else self.head)


def rank_params(split: Split) -> RankParams:
    """The parameters of one rank of ``split`` (ranks 1: the whole model, as ``models/decoder.py`` builds it)."""
    config = split.config
    h, d = config.hidden_size, config.head_dim
    q, kv = split.width("query"), split.width("kv")
    # a column split cuts a projection's outputs, a row split its inputs; the other side is the hidden state
    projections = tuple(Projection(p.module, h, split.width(p.unit)) if p.cut == "column" else
                        Projection(p.module, split.width(p.unit), h) for p in PROJECTIONS)
    per_layer = 2 * h                                           # input and post-attention RMSNorm weights
    per_layer += 2 * d if config.qk_norm else 0                 # Qwen3's per-head q/k norms (shared by the heads)
    per_layer += q + 2 * kv if config.attention_bias else 0     # Qwen2's q/k/v biases, split with their columns
    head_rows = config.head_vocab_size or config.vocab_size
    return RankParams(layers=config.num_layers, projections=projections, small=config.num_layers * per_layer + h,
                      embedding=config.vocab_size * h, head=head_rows * h,
                      tied=config.tie_word_embeddings and config.head_vocab_size is None)
