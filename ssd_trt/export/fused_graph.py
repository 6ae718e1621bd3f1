"""The ONNX Runtime step graph written directly on its fused contrib ops (the ``ort`` flavour's fast form).

The traced graph (``onnx_export.py``) spells each decoder layer in ~100 standard ops; ONNX Runtime's CPU
provider then pays a dispatch per node (3117 nodes a step for SmolLM2-135M, half of the step outside the
weight MatMuls: docs/bench/profiles/). Here the same function is written layer by layer as

    SkipSimplifiedLayerNormalization (norm + residual add)
    -> one packed q|k|v projection -> GroupQueryAttention (in-op rotary at per-token positions, the step's
       tree visibility as ``attention_bias``, the KV cache written in place: past and present bound to one buffer)
    -> o projection -> SkipSimplifiedLayerNormalization -> one packed gate|up projection -> SiLU(gate)*up -> down

Every projection is ``DequantizeLinear -> MatMul`` over the block weights (ONNX Runtime fuses the pair into
one ``MatMulNBits``, with the accuracy level the session asks for), or a plain MatMul for float weights;
a kind's per-block minimum (Q4_1, Q4_K, Q5_K, ...) stays the exact side term of ``block_weights.block_matmul``. Packing q|k|v (and
gate|up) concatenates output columns; blocks run along K, so every column keeps its own integers and
scales: the packed product is, column for column, the separate products.

I/O is the step-graph contract of ``engines/base.py`` unchanged, so the runtime cannot tell the forms apart.

The writer reads the weights through :class:`StepWeights`, one decoder layer at a time: a loaded model
(:class:`LoadedWeights`), or a checkpoint too large to hold, read layer by layer (``streamed_fused.CheckpointWeights``)
with every initializer written straight to the external weight file (``sink``) as it is made.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ssd_trt_plugins.tree_attention.onnx_function import mask_nodes
from ssd_trt.engines.base import GRAPH_META_ONE_TOKEN_TWICE, GRAPH_OUTPUT_LOGITS, past_names, present_names
from ssd_trt.export.block_weights import block_matmul
from ssd_trt.export.onnx_export import CACHE_AXES, STEP_DYNAMIC_AXES
from ssd_trt.models.config import DecoderConfig
from ssd_trt.models.decoder import Decoder, DecoderLayer, RMSNorm
from ssd_trt.models.gguf_blocks import BlockWeight

if TYPE_CHECKING:
    from ssd_trt.export.streamed import ExternalWeights

MS_DOMAIN = "com.microsoft"
OPSET = 23            # RMSNormalization (block-32 DequantizeLinear and INT4 since 21)
INLINE_BYTES = 1024   # initializers smaller than this stay in the graph (as save_flavours leaves them)
ONE_TOKEN_TEST = "fused.one64"   # the T a step must have for attention to see its token twice


def unsupported_reason(model) -> str | None:
    """Why ``model`` keeps the traced graph, or None when the fused form covers it."""
    if not isinstance(model, Decoder):
        return f"traced: a {type(model).__name__} has its own step graph (onnx_export.py)"
    if model.feature_layers:
        return "traced: a target returning features for an EAGLE-3 draft keeps the traced graph"
    return config_reason(model.config)


def config_reason(config: DecoderConfig) -> str | None:
    """Why a decoder of this shape keeps the traced graph, or None."""
    if config.head_dim % 16:
        return (f"traced: head_dim {config.head_dim} is not a multiple of 16, which ONNX Runtime's "
                f"GroupQueryAttention requires")
    return None


class StepWeights(Protocol):
    """A decoder's weights as the fused writer reads them, in order: the embedding, each layer, the head.
    Block weights are keyed by the Decoder's module names (``layers.3.mlp.up_proj``, ``lm_head``)."""
    config: DecoderConfig
    inv_freq: torch.Tensor
    head_token_ids: np.ndarray | None      # a reduced draft head's token ids

    def embedding(self) -> torch.Tensor: ...

    def layer(self, index: int) -> tuple[DecoderLayer, dict[str, BlockWeight]]: ...

    def head(self) -> tuple[RMSNorm, torch.nn.Module, dict[str, BlockWeight]]: ...


@dataclass
class LoadedWeights:
    """:class:`StepWeights` of a model in memory."""
    model: Decoder
    blocks: dict[str, BlockWeight]

    @property
    def config(self) -> DecoderConfig:
        return self.model.config

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.model.inv_freq

    @property
    def head_token_ids(self) -> np.ndarray | None:
        ids = self.model.lm_head_token_ids
        return None if ids is None else ids.numpy()

    def embedding(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    def layer(self, index: int) -> tuple[DecoderLayer, dict[str, BlockWeight]]:
        return self.model.layers[index], self.blocks

    def head(self) -> tuple[RMSNorm, torch.nn.Module, dict[str, BlockWeight]]:
        model = self.model
        return model.norm, model.lm_head if model.lm_head is not None else TiedHead(model.embed_tokens.weight), \
            self.blocks


class _Graph:
    """Nodes and initializers being written, with unique names. With a ``sink``, every initializer of
    ``INLINE_BYTES`` or more goes to the external weight file as it is made (the graph holds only its place)."""

    def __init__(self, sink: "ExternalWeights | None" = None) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.sink = sink

    def node(self, op: str, inputs: list[str], outputs: list[str] | str, domain: str = "", **attributes) -> str:
        outputs = [outputs] if isinstance(outputs, str) else outputs
        self.nodes.append(helper.make_node(op, inputs, outputs, name=outputs[0], domain=domain or None,
                                           **attributes))
        return outputs[0]

    def constant(self, name: str, value: np.ndarray) -> str:
        value = np.ascontiguousarray(value)
        if self.sink is not None and value.nbytes >= INLINE_BYTES:
            self.initializers.append(self.sink.store(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape,
                                                     memoryview(value.reshape(-1)).cast("B")))
        else:
            self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def add(self, tensors: list[onnx.TensorProto]) -> None:
        """Initializers made elsewhere (``block_matmul``'s), moved to the sink like :meth:`constant`'s."""
        for tensor in tensors:
            if self.sink is not None and len(tensor.raw_data) >= INLINE_BYTES:
                tensor = self.sink.store(tensor.name, tensor.data_type, tuple(tensor.dims), tensor.raw_data)
            self.initializers.append(tensor)


def _weight_t(module: torch.nn.Linear) -> np.ndarray:
    """W [K, N] (y = x W) of a linear layer, fp32."""
    return module.weight.detach().float().numpy().T


def _packed_blocks(parts: list[BlockWeight]) -> BlockWeight | None:
    """The blocks of [W_1 | W_2 | ...] (output columns side by side), or None when the parts differ in bits or in
    block size (one DequantizeLinear has one of each: Q4_K q|k beside a Q6_K v stay apart). A part without
    offsets gets zero offsets in the same blocks: its side term adds exact zeros."""
    if len({(part.bits, part.block) for part in parts}) != 1:
        return None
    offsets = None
    if any(part.offsets is not None for part in parts):
        offsets = np.concatenate([part.offsets if part.offsets is not None else np.zeros_like(part.scales)
                                  for part in parts], axis=1)
    return BlockWeight(np.concatenate([p.values for p in parts], axis=1),
                       np.concatenate([p.scales for p in parts], axis=1), offsets, parts[0].bits,
                       "+".join(sorted({p.kind for p in parts})), parts[0].block)


def _projection(graph: _Graph, x: str, prefix: str, modules: list[torch.nn.Linear], names: list[str],
                blocks: dict[str, BlockWeight]) -> list[str]:
    """y = x [W_1 | W_2 | ...] (+ biases): one MatMul when the parts pack, else one per part; returns the
    output names (one packed output, or one per part)."""
    block_parts = [blocks.get(name) for name in names]
    if all(block_parts) and (packed := _packed_blocks(block_parts)) is not None:
        groups = [(prefix, packed, modules)]
    elif not any(block_parts):
        groups = [(prefix, np.concatenate([_weight_t(m) for m in modules], axis=1), modules)]
    else:
        groups = [(name, blocks[name] if name in blocks else _weight_t(m), [m]) for name, m in zip(names, modules)]
    outputs = []
    for name, weight, members in groups:
        out = f"{name}.out"
        matmul = helper.make_node("MatMul", [x, f"{name}.weight_t"], [out], name=f"{name}.matmul")
        if isinstance(weight, BlockWeight):
            ahead, behind, inits = block_matmul(name, matmul, weight)
            graph.nodes += [*ahead, matmul, *behind]
            graph.add(inits)
        else:
            graph.constant(f"{name}.weight_t", weight.astype(np.float32))
            graph.nodes.append(matmul)
        member_biases = [m.bias for m in members]
        if any(b is not None for b in member_biases):
            bias = np.concatenate([(b.detach().float().numpy() if b is not None else np.zeros(m.out_features, np.float32))
                                   for b, m in zip(member_biases, members)])
            out = graph.node("Add", [out, graph.constant(f"{name}.bias", bias)], f"{name}.biased")
        outputs.append(out)
    return outputs


def _rotary_cache(inv_freq: torch.Tensor, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin [P, D/2] of every position's rotary angles, computed as the torch model computes them (fp32
    angles position * theta^(-2i/D), fp32 cos / sin), so the fused graph rotates by the model's own angles."""
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    return angles.cos().numpy(), angles.sin().numpy()


def _attention_preamble(graph: _Graph) -> dict[str, str]:
    """Per-step tensors every layer's GroupQueryAttention reads: seqlens_k [B] (= L_b + T' - 1), the total
    length (max_b L_b + T', scalar), the additive bias [B, 1, T', total] (0 where visible, -inf elsewhere),
    query_seqlens [B] (= T') and the position ids [B, T'].

    T' is the step's T, or 2 when T = 1 (:func:`_one_token_twice`): ONNX Runtime's attention multiplies
    a one-query step's probabilities by V on another kernel (a matrix-vector product) than a step of two or
    more queries, and the two sum in different orders (a token's logits moved by up to 0.5 between being
    decoded alone and being verified in a chain; docs/weights.md "Row-exact steps"). Attending a one-token
    step as two queries (the token twice: the copy's key sits one slot past the row's end, invisible to the
    real query, and its output is dropped) keeps every step on the one kernel, so decoding, verifying and
    drafting give a token bit-identical logits while the projections still see one token per row."""
    g = graph
    g.constant("fused.ax0", np.array([0], np.int64))
    g.constant("fused.ax1", np.array([1], np.int64))
    t = g.node("Shape", ["input_ids"], "fused.T", start=1, end=2)                      # [1] int64
    one = g.constant(ONE_TOKEN_TEST, np.array([1], np.int64))
    extra = g.node("Cast", [g.node("Equal", [t, one], "fused.one_token")], "fused.extra_query",
                   to=TensorProto.INT64)                                               # [1]: 1 when T = 1, else 0
    t_attended = g.node("Add", [t, extra], "fused.T_attended")
    t32 = g.node("Cast", [t_attended], "fused.T32", to=TensorProto.INT32)
    ends = g.node("Add", ["cache_lengths", t32], "fused.ends")                         # L_b + T'
    seqlens = g.node("Sub", [ends, g.constant("fused.one32", np.array([1], np.int32))], "fused.seqlens_k")
    # every row adds T' tokens (a batched step with a past needs the per-row count)
    query_seqlens = g.node("Expand", [t32, g.node("Shape", ["cache_lengths"], "fused.B")], "fused.query_seqlens")
    total = g.node("ReduceMax", [ends], "fused.total", keepdims=0)                      # scalar int32
    total1 = g.node("Cast", [g.node("Unsqueeze", [total, "fused.ax0"], "fused.total1")], "fused.total64",
                    to=TensorProto.INT64)
    # the mask of the real T queries: slots from L_b + T on (the copy's key) are invisible to them
    g.nodes += mask_nodes("fused.mask_", "cache_lengths", "tree_mask", "", "fused.allowed5", width=total1)
    allowed = g.node("Squeeze", ["fused.allowed5", g.constant("fused.ax2", np.array([2], np.int64))],
                     "fused.allowed")                                                  # [B, 1, T, total]
    bias = g.node("Where", [allowed, g.constant("fused.zero_f", np.array(0, np.float32)),
                            g.constant("fused.neg_inf", np.array(-np.inf, np.float32))], "fused.attention_bias")
    # the copy's query row sees every slot (bias 0): its output is dropped, it only must not be all -inf
    zero = g.constant("fused.zero64", np.array([0], np.int64))
    bias_pads = g.node("Concat", [zero] * 6 + [extra, zero], "fused.bias_pads", axis=0)
    bias = g.node("Pad", [bias, bias_pads, "fused.zero_f"], "fused.attention_bias_attended")
    return {"seqlens_k": seqlens, "total": total, "bias": bias, "query_seqlens": query_seqlens,
            "position_ids": _one_token_twice(g, "position_ids", extra), "extra": extra, "T": t}


def without_one_token_copy(graph: onnx.ModelProto) -> onnx.ModelProto:
    """``graph`` (a fused step graph) with the one-token copy switched off: its T = 1 test is never true, so a
    one-token step attends one query (what row exactness is measured against: docs/weights.md)."""
    for tensor in graph.graph.initializer:
        if tensor.name == ONE_TOKEN_TEST:
            tensor.CopyFrom(numpy_helper.from_array(np.array([-1], np.int64), tensor.name))
            return graph
    raise ValueError(f"not a fused step graph with a one-token copy: no initializer {ONE_TOKEN_TEST!r}")


def _one_token_twice(graph: _Graph, tensor: str, extra: str) -> str:
    """[B, T, ...] with its first token appended once more when ``extra`` is 1 (a one-token step), else as it is."""
    copy = graph.node("Slice", [tensor, "fused.ax0", extra, "fused.ax1"], f"{tensor}.copied")
    return graph.node("Concat", [tensor, copy], f"{tensor}.attended", axis=1)


def fused_step_graph(model: Decoder, blocks: dict[str, BlockWeight] | None, max_positions: int) -> onnx.ModelProto:
    """The ``ort`` flavour's step graph of ``model`` on fused ops (module docstring). ``blocks``: the block
    weights by module name (``block_weights.model_block_weights``); ``max_positions``: the rotary table's
    length (every position id must be below it: the engine's max_context)."""
    reason = unsupported_reason(model)
    if reason:
        raise ValueError(reason)
    return write_fused_graph(LoadedWeights(model, blocks or {}), max_positions)


def write_fused_graph(weights: StepWeights, max_positions: int, sink: "ExternalWeights | None" = None
                      ) -> onnx.ModelProto:
    """The fused step graph of ``weights`` (one layer read at a time); with ``sink``, its initializers are
    written to that external weight file as they are made."""
    reason = config_reason(weights.config)
    if reason:
        raise ValueError(reason)
    c, g = weights.config, _Graph(sink)
    with torch.no_grad():
        g.constant("model.embed_tokens.weight", weights.embedding().detach().float().numpy())
        cos, sin = _rotary_cache(weights.inv_freq, max_positions)
        g.constant("fused.cos_cache", cos)
        g.constant("fused.sin_cache", sin)
        x = g.node("Gather", ["model.embed_tokens.weight", "input_ids"], "fused.embedded")
        attention = _attention_preamble(g)
        residual, pending = x, None        # pending: the last sublayer's output, not yet added to the residual
        for i in range(c.num_layers):
            layer, blocks = weights.layer(i)
            p, attn, mlp = f"layers.{i}", layer.self_attn, layer.mlp
            normed, residual = _norm(g, f"{p}.input_layernorm", layer.input_layernorm, residual, pending)
            qkv = _projection(g, normed, f"{p}.self_attn.qkv_proj", [attn.q_proj, attn.k_proj, attn.v_proj],
                              [f"{p}.self_attn.{n}_proj" for n in "qkv"], blocks)
            if attn.q_norm is not None:     # Qwen3 (GroupQueryAttention's own q/k norm is not on CPU)
                qkv = _qk_norm(g, f"{p}.self_attn", qkv, attn, c)
            query = [_one_token_twice(g, part, attention["extra"]) for part in qkv]
            query = query if len(query) == 3 else [query[0], "", ""]
            past_key, past_value = past_names(i)
            g.node("GroupQueryAttention",
                   [*query, past_key, past_value, attention["seqlens_k"], attention["total"], "fused.cos_cache",
                    "fused.sin_cache", attention["position_ids"], attention["bias"], "", "", "", "", "",
                    attention["query_seqlens"]],
                   [f"{p}.self_attn.attended", *present_names(i)], domain=MS_DOMAIN, num_heads=c.num_heads,
                   kv_num_heads=c.num_kv_heads, do_rotary=1, rotary_interleaved=0, scale=attn.scale)
            g.node("Slice", [f"{p}.self_attn.attended", "fused.ax0", attention["T"], "fused.ax1"],
                   f"{p}.self_attn.out")                                 # the real T queries' outputs
            pending = _projection(g, f"{p}.self_attn.out", f"{p}.self_attn.o_proj", [attn.o_proj],
                                  [f"{p}.self_attn.o_proj"], blocks)[0]
            normed, residual = _norm(g, f"{p}.post_attention_layernorm", layer.post_attention_layernorm,
                                     residual, pending)
            gate_up = _projection(g, normed, f"{p}.mlp.gate_up_proj", [mlp.gate_proj, mlp.up_proj],
                                  [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], blocks)
            if len(gate_up) == 1:      # packed: split the columns back
                packed, gate_up = gate_up[0], [f"{p}.mlp.gate", f"{p}.mlp.up"]
                g.node("Split", [packed], gate_up, axis=-1, num_outputs=2)
            gate, up = gate_up
            silu = g.node("Mul", [gate, g.node("Sigmoid", [gate], f"{p}.mlp.sigmoid")], f"{p}.mlp.silu")
            hidden = g.node("Mul", [silu, up], f"{p}.mlp.act")
            pending = _projection(g, hidden, f"{p}.mlp.down_proj", [mlp.down_proj], [f"{p}.mlp.down_proj"],
                                  blocks)[0]
            del layer, blocks
        final_norm, head, blocks = weights.head()
        normed, _ = _norm(g, "norm", final_norm, residual, pending)
        # only the picked tokens pay the LM head: GatherND over [B, T, H] with [B, L, 1] indices, per row
        index = g.node("Unsqueeze", ["logit_indices", g.constant("fused.ax_last", np.array([-1], np.int64))],
                       "fused.logit_index3")
        picked = g.node("GatherND", [normed, index], "fused.picked", batch_dims=1)
        logits = _projection(g, picked, "lm_head", [head], ["lm_head"], blocks)[0]
        if weights.head_token_ids is not None:
            logits = _scatter_reduced_head(g, logits, weights.head_token_ids, c.vocab_size)
        g.node("Identity", [logits], GRAPH_OUTPUT_LOGITS)
    return _model(g, c)


class TiedHead(torch.nn.Module):
    """The LM head of a tied model: the embedding matrix, read as a linear layer's weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.bias, self.out_features = weight, None, weight.shape[0]


def _qk_norm(graph: _Graph, prefix: str, qkv: list[str], attn, c) -> list[str]:
    """Qwen3's per-head RMSNorm of q and k (before rotary): [q, k, v] with q and k normalised head by head."""
    g = graph
    if len(qkv) == 1:      # packed: split the columns back
        widths = np.array([c.num_heads, c.num_kv_heads, c.num_kv_heads], np.int64) * c.head_dim
        parts = [f"{prefix}.q", f"{prefix}.k", f"{prefix}.v"]
        g.node("Split", [qkv[0], g.constant(f"{prefix}.qkv_widths", widths)], parts, axis=-1)
        qkv = parts
    normed = []
    for name, x, norm, heads in (("q", qkv[0], attn.q_norm, c.num_heads), ("k", qkv[1], attn.k_norm, c.num_kv_heads)):
        per_head = g.node("Reshape", [x, g.constant(f"{prefix}.{name}_heads_shape",
                                                    np.array([0, 0, heads, c.head_dim], np.int64))], f"{prefix}.{name}_heads")
        gamma = g.constant(f"{prefix}.{name}_norm.weight", norm.weight.detach().float().numpy())
        out = g.node("RMSNormalization", [per_head, gamma], f"{prefix}.{name}_normed", axis=-1, epsilon=norm.eps)
        normed.append(g.node("Reshape", [out, g.constant(f"{prefix}.{name}_flat_shape",
                                                         np.array([0, 0, heads * c.head_dim], np.int64))],
                             f"{prefix}.{name}_flat"))
    return [*normed, qkv[2]]


def _norm(graph: _Graph, name: str, norm, residual: str, pending: str | None) -> tuple[str, str]:
    """RMSNorm of residual + pending (the sum becomes the new residual): one fused node."""
    gamma = graph.constant(f"{name}.weight", norm.weight.detach().float().numpy())
    if pending is None:
        return graph.node("RMSNormalization", [residual, gamma], f"{name}.out", axis=-1, epsilon=norm.eps), residual
    outputs = [f"{name}.out", "", "", f"{name}.residual"]
    graph.node("SkipSimplifiedLayerNormalization", [pending, residual, gamma], outputs, domain=MS_DOMAIN,
               epsilon=norm.eps)
    return outputs[0], outputs[3]


def _scatter_reduced_head(graph: _Graph, logits: str, token_ids: np.ndarray, vocab: int) -> str:
    """A reduced draft head's [B, L, V'] logits placed into [B, L, V] at its token ids; -inf elsewhere (q = 0)."""
    g = graph
    shape = g.node("Shape", [logits], "lm_head.small_shape")
    full_shape = g.node("Concat", [g.node("Shape", [logits], "lm_head.rows", start=0, end=2),
                                   g.constant("lm_head.vocab", np.array([vocab], np.int64))], "lm_head.full_shape",
                        axis=0)
    full = g.node("ConstantOfShape", [full_shape], "lm_head.neg_inf_full",
                  value=numpy_helper.from_array(np.array([-np.inf], np.float32)))
    ids = g.constant("lm_head.token_ids", token_ids.astype(np.int64).reshape(1, 1, -1))
    index = g.node("Expand", [ids, shape], "lm_head.index")
    return g.node("ScatterElements", [full, index, logits], "lm_head.scattered", axis=2)


def _model(graph: _Graph, c: DecoderConfig) -> onnx.ModelProto:
    float_t = TensorProto.FLOAT

    def value(name: str, dtype: int, axes: dict[int, str], static: dict[int, int], rank: int):
        dims = [axes.get(i, static.get(i)) for i in range(rank)]
        return helper.make_tensor_value_info(name, dtype, dims)

    cache_static = {1: c.num_kv_heads, 3: c.head_dim}
    inputs = [value("input_ids", TensorProto.INT64, STEP_DYNAMIC_AXES["input_ids"], {}, 2),
              value("position_ids", TensorProto.INT64, STEP_DYNAMIC_AXES["position_ids"], {}, 2),
              value("tree_mask", TensorProto.INT32, STEP_DYNAMIC_AXES["tree_mask"], {}, 3),
              value("cache_lengths", TensorProto.INT32, STEP_DYNAMIC_AXES["cache_lengths"], {}, 1),
              value("logit_indices", TensorProto.INT64, STEP_DYNAMIC_AXES["logit_indices"], {}, 2)]
    outputs = [value(GRAPH_OUTPUT_LOGITS, float_t, STEP_DYNAMIC_AXES["logits"], {2: c.vocab_size}, 3)]
    for i in range(c.num_layers):
        inputs += [value(name, float_t, CACHE_AXES, cache_static, 4) for name in past_names(i)]
        outputs += [value(name, float_t, CACHE_AXES, cache_static, 4) for name in present_names(i)]
    graph_proto = helper.make_graph(graph.nodes, "ssd_trt_fused_step", inputs, outputs, graph.initializers)
    proto = helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", OPSET),
                                                          helper.make_opsetid(MS_DOMAIN, 1)],
                              producer_name="ssd_trt.export.fused_graph")
    proto.ir_version = 10
    helper.set_model_props(proto, {GRAPH_META_ONE_TOKEN_TWICE: "1"})
    return proto
