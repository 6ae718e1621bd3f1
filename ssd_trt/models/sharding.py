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

:data:`PROJECTIONS` is the one table of that split, projection by projection; everything that splits, counts or
reduces reads it: the ONNX/TensorRT export (``export/tensor_parallel.py``: each rank's weight slices and the
all-reduce markers), the TensorRT build (``trt/collectives.py``: the markers it replaces), the rank runtime
(``models/rank_decoder.py``: slices and the all-reduce after each row-split product) and the sizing
(``sizing/shards.py``: each rank's projection shapes). The functions work on the HF checkpoint's own names and
layout ([out, in] weights). Nothing here reads weights: :func:`rank_split` runs on the config alone, before any
work.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from ssd_trt.errors import RecipeError
from ssd_trt.models.config import DecoderConfig

if TYPE_CHECKING:
    import onnx

MAX_RANKS = 64     # EngineRecipe.tensor_parallel's upper bound

Cut = Literal["column", "row"]
Unit = Literal["query", "kv", "mlp"]


@dataclass(frozen=True, slots=True)
class ProjectionSplit:
    """How one projection of every decoder layer splits over the ranks."""
    module: str     # its path in a decoder layer, as HF and models/decoder.py name it
    cut: Cut        # column: each rank computes some outputs; row: each rank reads some inputs
    unit: Unit      # what the cut dimension counts: query heads, key/value heads or MLP columns

    @property
    def axis(self) -> int:
        """The axis of the HF weight ([out, in]) that is cut: outputs for a column split, inputs for a row split."""
        return 0 if self.cut == "column" else 1

    @property
    def reduced(self) -> bool:
        """Whether an all-reduce follows the product: a row split's product is a partial sum over its inputs."""
        return self.cut == "row"


# The split, in the order the projections come in a layer (the sizing's first projection is q_proj: it reads the
# hidden state, the width the LM head reads too).
PROJECTIONS = (
    ProjectionSplit("self_attn.q_proj", "column", "query"),
    ProjectionSplit("self_attn.k_proj", "column", "kv"),
    ProjectionSplit("self_attn.v_proj", "column", "kv"),
    ProjectionSplit("self_attn.o_proj", "row", "query"),
    ProjectionSplit("mlp.gate_proj", "column", "mlp"),
    ProjectionSplit("mlp.up_proj", "column", "mlp"),
    ProjectionSplit("mlp.down_proj", "row", "mlp"),
)
# the projections whose products are partial sums over the ranks, in the order they come in a layer
REDUCED = tuple(p.module for p in PROJECTIONS if p.reduced)
_BY_MODULE = {p.module: p for p in PROJECTIONS}
_LAYER_TENSOR = re.compile(r"^model\.layers\.\d+\.(?P<module>.+)\.(?P<kind>weight|bias)$")

# A rank graph marks each reduced product with an Identity node of this name; the TensorRT build replaces it by its
# native all-reduce (ONNX has no all-reduce op, and TensorRT's parser keeps an Identity's name).
MARKER_PREFIX = "tp_all_reduce/"
MARKER = re.compile(r"^" + re.escape(MARKER_PREFIX) + r"layers\.(\d+)\.(" + "|".join(map(re.escape, REDUCED)) + ")$")


def marker_name(layer: int, module: str) -> str:
    """The all-reduce marker after ``module``'s product in decoder layer ``layer``."""
    return f"{MARKER_PREFIX}layers.{layer}.{module}"


def marker_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The all-reduce markers of a rank graph, in graph order."""
    return [node for node in model.graph.node if node.op_type == "Identity" and MARKER.match(node.name)]


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

    def width(self, unit: Unit) -> int:
        """How much of a cut dimension counted in ``unit`` one rank holds."""
        d = self.config.head_dim
        return {"query": self.heads * d, "kv": self.kv_heads * d, "mlp": self.intermediate}[unit]

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
        match = _LAYER_TENSOR.match(name)
        projection = _BY_MODULE.get(match["module"]) if match else None
        # a row-split bias would be added once after the sum: whole (the supported decoders have none)
        if projection is None or (match["kind"] == "bias" and projection.cut == "row"):
            return None
        # the ranks replicating a key/value head hold the same block of it
        block = rank // self.kv_replicas if projection.unit == "kv" else rank
        width = self.width(projection.unit)
        return projection.axis, block * width, (block + 1) * width

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

    def shard_numel(self, shapes: dict[str, tuple[int, ...]]) -> int:
        """Elements one rank holds (every rank holds as many) of HF tensors of ``shapes`` (the whole model's)."""
        total = 0
        for name, shape in shapes.items():
            count = 1
            for size in self.shape(name, shape, 0):
                count *= size
            total += count
        return total


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


def valid_ranks(config: DecoderConfig, up_to: int = MAX_RANKS) -> list[int]:
    """Every tensor_parallel from 1 to ``up_to`` that splits ``config`` evenly."""
    return [n for n in range(1, up_to + 1) if split_problem(config, n) is None]


def rank_split(config: DecoderConfig, ranks: int, where: str = "the target") -> Split:
    """The split of ``config`` over ``ranks``; a RecipeError (the recipe's engine.tensor_parallel) saying what does
    not divide and which sizes would."""
    problem = split_problem(config, ranks)
    if problem is not None:
        raise RecipeError(f"engine.tensor_parallel: {ranks} cannot split {where}: {problem} "
                          f"({config.num_heads} query heads, {config.num_kv_heads} key/value heads, MLP width "
                          f"{config.intermediate_size}); choose one of {valid_ranks(config)}")
    return Split(config, ranks)
