"""How a decoder splits over ``ranks`` tensor-parallel ranks (Megatron-style), tensor by tensor, from HF names.

Each rank holds:

* attention: a contiguous block of H/N query heads (rows of q_proj, columns of o_proj) and the key/value heads
  those query heads read. With at least N key/value heads each rank takes KV/N of them; with fewer (GQA with a
  small KV count), each key/value head is replicated on the N/KV ranks whose query heads read it, as vLLM does;
* MLP: a contiguous block of I/N columns of gate_proj and up_proj and the same rows of down_proj;
* everything else whole: the embedding, the norms (q/k norms act per head, so they are the same on every rank)
  and the LM head.

So the two row-split products (o_proj, down_proj) each give a partial sum of the full result: summing them
over the ranks (an all-reduce) restores the whole model's output exactly, up to the order of the additions.

The functions work on the HF checkpoint's own names and layout ([out, in] weights), so the ONNX/TensorRT export
(``export/tensor_parallel.py``) and a runtime over ranks slice with the same rules. Nothing here reads weights:
:func:`check_split` runs on the config alone, before any work.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from ssd_trt.models.config import DecoderConfig

_LAYER = r"^model\.layers\.\d+\."
# (pattern, axis of the HF tensor to split, what its rows/columns are counted in)
_RULES = (
    (re.compile(_LAYER + r"self_attn\.q_proj\.(weight|bias)$"), 0, "query"),
    (re.compile(_LAYER + r"self_attn\.(k_proj|v_proj)\.(weight|bias)$"), 0, "kv"),
    (re.compile(_LAYER + r"self_attn\.o_proj\.weight$"), 1, "query"),
    (re.compile(_LAYER + r"mlp\.(gate_proj|up_proj)\.weight$"), 0, "mlp"),
    (re.compile(_LAYER + r"mlp\.down_proj\.weight$"), 1, "mlp"),
)


@dataclass(frozen=True, slots=True)
class Split:
    """The split of one decoder over ``ranks``: per-rank head and MLP sizes, and which KV heads each rank holds."""
    config: DecoderConfig
    ranks: int

    @property
    def heads(self) -> int:
        """Query heads per rank."""
        return self.config.num_heads // self.ranks

    @property
    def kv_heads(self) -> int:
        """Key/value heads per rank (1, replicated, when the model has fewer than ``ranks``)."""
        return max(1, self.config.num_kv_heads // self.ranks)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each key/value head (1: no replication)."""
        return max(1, self.ranks // self.config.num_kv_heads)

    @property
    def intermediate(self) -> int:
        """MLP columns per rank."""
        return self.config.intermediate_size // self.ranks

    def rank_config(self) -> DecoderConfig:
        """The decoder one rank runs: the whole model's, with its own head counts and MLP width (head_dim,
        hence the attention scale and the rotary tables, unchanged)."""
        return dataclasses.replace(self.config, num_heads=self.heads, num_kv_heads=self.kv_heads,
                                   intermediate_size=self.intermediate)

    def kv_head_range(self, rank: int) -> tuple[int, int]:
        """[first, last) key/value heads of the whole model that ``rank`` holds."""
        first = rank // self.kv_replicas * self.kv_heads
        return first, first + self.kv_heads

    def rows(self, name: str, rank: int) -> tuple[int, int, int] | None:
        """(axis, start, stop) of HF tensor ``name`` that ``rank`` holds; None: the rank holds it whole."""
        for pattern, axis, unit in _RULES:
            if pattern.match(name):
                break
        else:
            return None
        d = self.config.head_dim
        if unit == "query":
            return axis, rank * self.heads * d, (rank + 1) * self.heads * d
        if unit == "kv":
            first, last = self.kv_head_range(rank)
            return axis, first * d, last * d
        return axis, rank * self.intermediate, (rank + 1) * self.intermediate

    def shard(self, name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s part of HF tensor ``name`` (a view: no copy)."""
        rows = self.rows(name, rank)
        return tensor if rows is None else tensor.narrow(rows[0], rows[1], rows[2] - rows[1])

    def shape(self, name: str, shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
        """The shape of ``rank``'s part of an HF tensor of ``shape``."""
        rows = self.rows(name, rank)
        if rows is None:
            return tuple(shape)
        axis, start, stop = rows
        return tuple(stop - start if i == axis else size for i, size in enumerate(shape))


def split_problem(config: DecoderConfig, ranks: int) -> str | None:
    """Why ``config`` cannot be split over ``ranks`` (None: it can)."""
    c = config
    if ranks < 1:
        return f"tensor_parallel must be at least 1, got {ranks}"
    if c.num_heads % ranks:
        return f"its {c.num_heads} attention heads do not divide into {ranks} ranks"
    if c.num_kv_heads >= ranks and c.num_kv_heads % ranks:
        return f"its {c.num_kv_heads} key/value heads do not divide into {ranks} ranks"
    if c.num_kv_heads < ranks and ranks % c.num_kv_heads:
        return (f"its {c.num_kv_heads} key/value heads cannot be replicated evenly over {ranks} ranks (with fewer "
                "key/value heads than ranks, the ranks must be a multiple of them)")
    if c.intermediate_size % ranks:
        return f"its MLP width {c.intermediate_size} does not divide into {ranks} ranks"
    return None


def check_split(config: DecoderConfig, ranks: int, where: str) -> Split:
    """The split of ``config`` over ``ranks``, or ValueError saying why not and which sizes would work."""
    problem = split_problem(config, ranks)
    if problem is not None:
        valid = [n for n in range(1, min(config.num_heads, 64) + 1) if split_problem(config, n) is None]
        raise ValueError(f"engine.tensor_parallel: {ranks} cannot split {where}: {problem} "
                         f"({config.num_heads} query heads, {config.num_kv_heads} key/value heads, MLP width "
                         f"{config.intermediate_size}); choose one of {valid}")
    return Split(config, ranks)


def rank_params(shapes: dict[str, tuple[int, ...]], split: Split) -> int:
    """Parameters one rank holds (every rank holds as many), from the whole model's HF tensor shapes."""
    total = 0
    for name, shape in shapes.items():
        count = 1
        for size in split.shape(name, shape, 0):
            count *= size
        total += count
    return total
