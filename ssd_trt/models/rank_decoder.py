"""One tensor-parallel rank's decoder: its shard of the target (the table of ``models/sharding.py``) in the project's
own :class:`~ssd_trt.models.decoder.Decoder`, with a sum over the ranks after each row-split product.

Megatron-LM's layout (Shoeybi et al. 2019, as vLLM runs it): q/k/v and gate/up are split by output columns, o_proj
and down_proj by input rows, so each rank's o_proj and down_proj give a partial sum of the whole layer's output and
one all-reduce after each (two per layer) makes every rank's residual stream the whole model's again. Everything
between the two reductions is local to a rank: its query heads attend with its key/value heads only (a query head
reads the key/value head ``j // (H / KV)``, and the split keeps each rank's query heads with the key/value head they
read, replicating key/value heads over ranks when there are fewer of them than ranks, as vLLM does).

The embedding and the LM head stay whole on every rank. The logits must end up whole on rank 0 anyway (the runtime
samples from all V of them), and a vocabulary-split head would need a gather of [B, T, V/N] per rank every step: a
collective on the critical path of every forward, for memory that is small next to the layers (Llama-3.1-70B's
embedding and head are 2 x 128256 x 8192 bf16 = 4.2 GB on every rank, 3% of the model's 141 GB; at N = 8 that is a
fifth of a rank's 21 GB of weights -- the cost to revisit first if ranks run short of memory).

:func:`load_rank_decoder` reads the checkpoint tensor by tensor and keeps only the rank's slice of each, so a rank
never holds the whole model (its peak is its shard plus one whole tensor).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ssd_trt.models.decoder import Decoder
from ssd_trt.models.sharding import REDUCED, rank_split

Reduce = Callable[[torch.Tensor], object]   # sums a tensor over the ranks, in place (torch.distributed.all_reduce)


class ReducedLinear(nn.Module):
    """A row-split linear layer and the all-reduce that completes its product (its partial sums added over the
    ranks). A row-split layer with a bias would have to add it once, after the sum; the decoder's o_proj and
    down_proj have none."""

    def __init__(self, linear: nn.Linear, reduce: Reduce) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("a row-split linear layer with a bias would add it once per rank; the decoder's "
                             "o_proj and down_proj have none")
        self.linear, self.reduce = linear, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.reduce(y)
        return y


def with_all_reduce(model: Decoder, reduce: Reduce) -> Decoder:
    """``model`` (a rank's shard) with the sum over the ranks after each layer's row-split products (the table's
    ``REDUCED``: o_proj and down_proj)."""
    for layer in model.layers:
        for module in REDUCED:
            parent, name = module.rsplit(".", 1)
            owner = layer.get_submodule(parent)
            setattr(owner, name, ReducedLinear(getattr(owner, name), reduce))
    return model


def _owned(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous copy of a slice in ``dtype`` (floats only), so the whole tensor it was cut from can be freed."""
    target = dtype if tensor.is_floating_point() else tensor.dtype
    return tensor.to(dtype=target, memory_format=torch.contiguous_format, copy=True)


def load_rank_decoder(path: Path | str, rank: int, ranks: int, dtype: torch.dtype = torch.float32,
                      reduce: Reduce | None = None) -> Decoder:
    """Rank ``rank`` of ``ranks``'s decoder from the HF checkpoint at ``path``: each tensor read, sliced and the
    rest dropped at once; ``reduce`` sums over the ranks (required when ``ranks`` > 1)."""
    from ssd_trt.models.checkpoint import Checkpoint
    from ssd_trt.models.loading import decoder_from_checkpoint
    checkpoint = Checkpoint.open(path)
    split = rank_split(checkpoint.config, ranks, f"the target {path}")
    state = {name: _owned(split.shard(name, checkpoint.tensor(name), rank), dtype) for name in checkpoint.tensors}
    model = decoder_from_checkpoint(checkpoint.hf_config, state, config=split.rank_config())
    return _reduced(model, ranks, reduce)


def rank_decoder(model: Decoder, rank: int, ranks: int, reduce: Reduce | None = None) -> Decoder:
    """Rank ``rank`` of ``ranks``'s shard of an in-memory decoder (copies of its slices; ``model`` is unchanged)."""
    from ssd_trt.models.loading import decoder_from_checkpoint
    split = rank_split(model.config, ranks, "this decoder")
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "inv_freq":
            continue
        hf_name = name if name.startswith("lm_head") else f"model.{name}"     # the rules read HF names
        state[hf_name] = _owned(split.shard(hf_name, tensor.detach(), rank), tensor.dtype)
    shard = decoder_from_checkpoint({}, state, config=split.rank_config())
    return _reduced(shard, ranks, reduce)


def _reduced(model: Decoder, ranks: int, reduce: Reduce | None) -> Decoder:
    if ranks == 1:
        return model                     # the whole model: nothing to sum
    if reduce is None:
        raise ValueError(f"a shard of {ranks} ranks needs the all-reduce that sums its partial products")
    return with_all_reduce(model, reduce)
