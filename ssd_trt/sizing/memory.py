"""Device memory of each engine of a recipe: weights, KV cache, activations and a fixed allowance, per GPU.

Target rank r of N is GPU r; the draft, whole, is GPU N (the paper's layout: four H100s verify, a fifth drafts).
Every term is computed from the recipe's limits and the model's config (``shards.py`` for each rank's share,
``formats.py`` for the bytes per element):

* weights: sum over the rank's tensors of elements x bytes per element.
* KV cache: max_batch x (max_context + 1) x layers x KV heads per rank x head_dim x 2 (K and V) x cache bytes. The
  GPU engines allocate max_context slots per row (``engines/device_step.py``); the + 1 is ONNX Runtime's scratch
  slot (``engines/ort.py``), counted everywhere to keep the estimate an upper bound.
* activations, three parts:
  - graph buffers: the CUDA-graph buckets' static logits, sum over buckets of rows x tokens x vocab x bytes
    (``engines/cuda_graphs.py``'s ``plan_buckets`` over the recipe's profiles: decode, verify and the tree sizes);
  - prefill logits: a device step computes every position's logits (``DeviceStepEngine.forward``), so the largest
    step, a prefill of max_batch rows x max_context tokens, holds max_batch x max_context x vocab x bytes (ONNX
    Runtime computes the picked positions only: max_batch x vocab x 4);
  - workspace: TensorRT reuses activation memory from layer to layer, so its execution context holds about one
    layer's live tensors at the largest step (tokens T = max_batch x max_context): T x bytes x the larger of the
    attention stage, 3 hidden (residual, normed, partial sum before the all-reduce) + (heads + 2 KV heads) x
    head_dim (q, k, v) + heads x head_dim (attention output), and the MLP stage, 3 hidden + 3 intermediate (gate,
    up, their product), per rank. Tree attention is a flash-style kernel: no T x S score matrix.
* fixed: 2 GiB per GPU for the CUDA context with torch, cuBLAS and the TensorRT runtime (about 1 GiB on a recent
  GPU) and NCCL's buffers on tensor-parallel ranks: an allowance, not a measurement.

A GPU fits when the sum is at most its memory less a tenth kept free (the share vLLM's default
gpu_memory_utilization of 0.9 leaves for fragmentation and what the estimate misses).
"""
from __future__ import annotations

from dataclasses import dataclass

from ssd_trt.engines.cuda_graphs import plan_buckets
from ssd_trt.engines.profiles import derive_profiles
from ssd_trt.models.config import DecoderConfig
from ssd_trt.models.sharding import Split, rank_split
from ssd_trt.recipe import Recipe
from ssd_trt.sizing.formats import BLOCK, Formats
from ssd_trt.sizing.shards import RankParams, rank_params

GIB = 1 << 30
FIXED_BYTES = 2 * GIB
HEADROOM = 0.10


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One GPU's share of a recipe, in bytes."""
    device: str
    role: str
    rank: int | None          # the target's rank (None: the draft, or a target of one rank)
    weights: int
    kv_cache: int
    graph_buffers: int
    prefill_logits: int
    workspace: int
    fixed: int

    @property
    def activations(self) -> int:
        return self.graph_buffers + self.prefill_logits + self.workspace

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.fixed


def weight_bytes(params: RankParams, formats: Formats) -> int:
    """Bytes of the weights one rank holds in ``formats`` (block formats only where in_features is a multiple of
    32; a tied head costs nothing where the engine reads the embedding as its head)."""
    linear = 0.0
    for projection in params.projections:
        size = formats.linear if not formats.blocks or projection.in_features % BLOCK == 0 else formats.dense
        linear += projection.numel * size
    hidden = params.projections[0].in_features          # the head's in_features
    head_size = formats.head if not formats.blocks or hidden % BLOCK == 0 else formats.dense
    head = 0.0 if params.tied and not formats.head_copy else params.head * head_size
    return int(round(params.layers * linear + (params.small + params.embedding) * formats.dense + head))


def kv_cache_bytes(split: Split, recipe: Recipe, formats: Formats) -> int:
    e, c = recipe.engine, split.config
    return e.max_batch * (e.max_context + 1) * c.num_layers * split.kv_heads * c.head_dim * 2 * formats.cache


def graph_buffer_bytes(config: DecoderConfig, recipe: Recipe, formats: Formats) -> int:
    """The CUDA-graph buckets' static logits buffers (none where no CUDA graph is captured: ONNX Runtime)."""
    if not formats.on_gpu:
        return 0
    vocab = config.head_vocab_size or config.vocab_size
    return sum(b.batch * b.tokens for b in plan_buckets(derive_profiles(recipe.engine.limits))) * vocab \
        * formats.activations


def prefill_logits_bytes(config: DecoderConfig, recipe: Recipe, formats: Formats) -> int:
    """A device step's logits for every position of the largest prefill; ONNX Runtime computes only the picked
    positions' (one a row)."""
    vocab = config.head_vocab_size or config.vocab_size
    positions = recipe.engine.max_context if formats.on_gpu else 1
    return recipe.engine.max_batch * positions * vocab * formats.activations


def workspace_bytes(split: Split, recipe: Recipe, formats: Formats) -> int:
    tokens = recipe.engine.max_batch * recipe.engine.max_context
    h, d = split.config.hidden_size, split.config.head_dim
    attention = 3 * h + (split.heads + 2 * split.kv_heads) * d + split.heads * d
    mlp = 3 * h + 3 * split.intermediate
    return tokens * max(attention, mlp) * formats.activations


def device_memory(device: str, role: str, rank: int | None, split: Split, recipe: Recipe, formats: Formats
                  ) -> DeviceMemory:
    """One engine's (or target rank's) memory on its device."""
    config = split.config
    return DeviceMemory(device=device, role=role, rank=rank,
                        weights=weight_bytes(rank_params(split), formats),
                        kv_cache=kv_cache_bytes(split, recipe, formats),
                        graph_buffers=graph_buffer_bytes(config, recipe, formats),
                        prefill_logits=prefill_logits_bytes(config, recipe, formats),
                        workspace=workspace_bytes(split, recipe, formats),
                        fixed=FIXED_BYTES if formats.on_gpu else 0)


def recipe_devices(recipe: Recipe, configs: dict[str, DecoderConfig], formats: dict[str, Formats]
                   ) -> list[DeviceMemory]:
    """Every device of the recipe: target ranks 0..N-1 on GPUs 0..N-1, the draft on GPU N. The split is even, so
    every rank holds as much as rank 0."""
    ranks = recipe.engine.tensor_parallel
    split = rank_split(configs["target"], ranks)
    unit = {role: "GPU" if formats[role].on_gpu else "CPU engine" for role in formats}
    devices = [device_memory(f"{unit['target']} {rank}", "target", rank if ranks > 1 else None, split, recipe,
                             formats["target"]) for rank in range(ranks)]
    draft = rank_split(configs["draft"], 1, "the draft")
    devices.append(device_memory(f"{unit['draft']} {ranks}", "draft", None, draft, recipe, formats["draft"]))
    return devices


def usable_bytes(gpu_memory_bytes: int) -> int:
    """What a device of ``gpu_memory_bytes`` may be planned to hold: a tenth stays free."""
    return int(gpu_memory_bytes * (1 - HEADROOM))
