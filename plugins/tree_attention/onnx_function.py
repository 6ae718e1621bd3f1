"""``ssd::tree_attention`` as a model-local ONNX function (standard ops), for ONNX Runtime.

ONNX Runtime inlines the function, so the custom node runs anywhere without a compiled plugin. The
decomposition follows reference.py step by step:
  1. write new K/V at slots L_b + t (ScatterElements on the slot axis);
  2. build the [B,T,S] visibility mask: prefix slots, plus the unpacked tree bits for new slots;
  3. grouped-query attention without materialising repeated K/V: queries are viewed as
     [B, Hkv, G, T, D] so every kv head serves its G query heads in one batched MatMul.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

DOMAIN = "ssd"
NAME = "tree_attention"
OPSET = 18
INPUTS = ["query", "key_new", "value_new", "key_cache", "value_cache", "cache_lengths", "tree_mask"]
OUTPUTS = ["output", "key_cache_out", "value_cache_out"]


def _const(name: str, array: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name))


def _i64(value) -> np.ndarray:
    return np.array(value, dtype=np.int64)


def mask_nodes(prefix: str, cache_lengths: str, tree_mask: str, shape_source: str, out: str,
               width: str | None = None) -> list[onnx.NodeProto]:
    """Nodes computing the bool visibility mask [B, 1, 1, T, S] into ``out`` (names prefixed).

    ``shape_source`` is any [B, Hkv, S, D] cache tensor (its dim 2 is the capacity S); T comes from the
    mask's own shape, so the subgraph depends only on per-step inputs and is shared by every layer.
    ``width``: a [1] int64 tensor giving S instead (``shape_source`` is then unused): the mask over the
    first ``width`` slots only.
    """
    n = helper.make_node
    x = lambda name: prefix + name  # noqa: E731
    slots = n("Shape", [shape_source], [x("S")], start=2, end=3) if width is None else \
        n("Identity", [width], [x("S")])
    return [
        _const(x("zero"), _i64(0)), _const(x("one"), _i64(1)), _const(x("two"), _i64(2)),
        _const(x("c32"), _i64(32)), _const(x("two_pow_32"), _i64(2 ** 32)),
        _const(x("pow2"), _i64([2 ** j for j in range(32)])),
        _const(x("ax0"), _i64([0])), _const(x("ax1"), _i64([1])), _const(x("ax12"), _i64([1, 2])),
        n("Shape", [tree_mask], [x("B")], start=0, end=1), n("Shape", [tree_mask], [x("T")], start=1, end=2),
        slots,
        n("Squeeze", [x("T"), x("ax0")], [x("T_s")]), n("Squeeze", [x("S"), x("ax0")], [x("S_s")]),
        n("Cast", [cache_lengths], [x("L")], to=TensorProto.INT64),
        n("Unsqueeze", [x("L"), x("ax1")], [x("L_col")]),
        n("Range", [x("zero"), x("T_s"), x("one")], [x("t_idx")]),
        n("Range", [x("zero"), x("S_s"), x("one")], [x("slots")]),
        n("Unsqueeze", [x("slots"), x("ax0")], [x("slots_row")]),
        n("Sub", [x("slots_row"), x("L_col")], [x("rel")]),                     # slot - L_b, [B, S]
        n("Less", [x("rel"), x("zero")], [x("in_prefix")]),
        n("Less", [x("rel"), x("T_s")], [x("below_end")]), n("Not", [x("in_prefix")], [x("after_start")]),
        n("And", [x("after_start"), x("below_end")], [x("in_new")]),
        # unpack bit j of row i: word j // 32, bit j % 32 (int32 words read as unsigned)
        n("Div", [x("t_idx"), x("c32")], [x("word_idx")]), n("Mod", [x("t_idx"), x("c32")], [x("bit_idx")]),
        n("Gather", [tree_mask, x("word_idx")], [x("words")], axis=2),
        n("Cast", [x("words")], [x("words64")], to=TensorProto.INT64),
        n("Less", [x("words64"), x("zero")], [x("negative")]),
        n("Add", [x("words64"), x("two_pow_32")], [x("words_wrapped")]),
        n("Where", [x("negative"), x("words_wrapped"), x("words64")], [x("unsigned")]),
        n("Gather", [x("pow2"), x("bit_idx")], [x("bit_weight")]),
        n("Div", [x("unsigned"), x("bit_weight")], [x("shifted")]), n("Mod", [x("shifted"), x("two")], [x("bit")]),
        n("Cast", [x("bit")], [x("new_bits")], to=TensorProto.BOOL),            # [B, T, T]
        n("Sub", [x("T_s"), x("one")], [x("T_last")]),
        n("Max", [x("rel"), x("zero")], [x("rel_lo")]), n("Min", [x("rel_lo"), x("T_last")], [x("rel_clipped")]),
        n("Unsqueeze", [x("rel_clipped"), x("ax1")], [x("rel_b1s")]),
        n("Concat", [x("B"), x("T"), x("S")], [x("bts")], axis=0),
        n("Expand", [x("rel_b1s"), x("bts")], [x("rel_bts")]),
        n("GatherElements", [x("new_bits"), x("rel_bts")], [x("tree_part")], axis=2),
        n("Unsqueeze", [x("in_new"), x("ax1")], [x("in_new_b1s")]),
        n("Unsqueeze", [x("in_prefix"), x("ax1")], [x("in_prefix_b1s")]),
        n("And", [x("in_new_b1s"), x("tree_part")], [x("new_visible")]),
        n("Or", [x("in_prefix_b1s"), x("new_visible")], [x("allowed")]),
        n("Unsqueeze", [x("allowed"), x("ax12")], [out]),                       # [B, 1, 1, T, S]
    ]


def attention_nodes(mask: str) -> list[onnx.NodeProto]:
    """Write the new K/V into the cache, then grouped-query attention under ``mask`` [B,1,1,T,S]."""
    n = helper.make_node
    scale = n("Constant", [], ["scale_c"])
    scale.attribute.append(AttributeProto(name="value_float", ref_attr_name="scale", type=AttributeProto.FLOAT))
    return [
        _const("a_ax0", _i64([0])), _const("a_ax13", _i64([1, 3])), _const("a_ax1", _i64([1])),
        _const("a_ax2", _i64([2])), _const("a_zero", _i64(0)), _const("a_one", _i64(1)),
        _const("neg_inf", np.array(-np.inf, dtype=np.float32)), scale,
        # 1. write the new entries at slots L_b + t
        n("Shape", ["key_new"], ["new_shape"]), n("Shape", ["key_new"], ["a_T"], start=2, end=3),
        n("Squeeze", ["a_T", "a_ax0"], ["a_T_s"]),
        n("Range", ["a_zero", "a_T_s", "a_one"], ["a_t_idx"]),
        n("Cast", ["cache_lengths"], ["a_L"], to=TensorProto.INT64),
        n("Unsqueeze", ["a_L", "a_ax1"], ["a_L_col"]), n("Unsqueeze", ["a_t_idx", "a_ax0"], ["a_t_row"]),
        n("Add", ["a_L_col", "a_t_row"], ["slot"]),
        n("Unsqueeze", ["slot", "a_ax13"], ["slot4"]),
        n("Expand", ["slot4", "new_shape"], ["write_index"]),
        n("ScatterElements", ["key_cache", "write_index", "key_new"], ["key_cache_out"], axis=2),
        n("ScatterElements", ["value_cache", "write_index", "value_new"], ["value_cache_out"], axis=2),
        # 2. grouped-query attention: queries viewed as [B, Hkv, G, T, D] against [B, Hkv, 1, S, D]
        n("Shape", ["query"], ["q_shape"]),
        n("Shape", ["query"], ["a_B"], start=0, end=1), n("Shape", ["query"], ["a_Hq"], start=1, end=2),
        n("Shape", ["query"], ["a_D"], start=3, end=4), n("Shape", ["key_cache"], ["a_Hkv"], start=1, end=2),
        n("Div", ["a_Hq", "a_Hkv"], ["G"]),
        n("Concat", ["a_B", "a_Hkv", "G", "a_T", "a_D"], ["q5_shape"], axis=0),
        n("Reshape", ["query", "q5_shape"], ["q5"]),
        n("Unsqueeze", ["key_cache_out", "a_ax2"], ["k5"]), n("Unsqueeze", ["value_cache_out", "a_ax2"], ["v5"]),
        n("Transpose", ["k5"], ["k5_t"], perm=[0, 1, 2, 4, 3]),
        n("MatMul", ["q5", "k5_t"], ["scores"]),
        n("Mul", ["scores", "scale_c"], ["scaled"]),
        n("Where", [mask, "scaled", "neg_inf"], ["masked"]),
        n("Softmax", ["masked"], ["probs"], axis=-1),
        n("MatMul", ["probs", "v5"], ["out5"]),
        n("Reshape", ["out5", "q_shape"], ["output"]),
    ]


def tree_attention_function() -> onnx.FunctionProto:
    """The op exactly as specified (7 inputs): mask built inside, then attention."""
    nodes = mask_nodes("m_", "cache_lengths", "tree_mask", "key_cache", "allowed5") + attention_nodes("allowed5")
    return helper.make_function(DOMAIN, NAME, INPUTS, OUTPUTS, nodes,
                                opset_imports=[helper.make_opsetid("", OPSET)], attributes=["scale"])


MASKED_NAME = "tree_attention_masked"


def masked_attention_function() -> onnx.FunctionProto:
    """ORT-flavour variant: the 7th input is the visibility mask [B,1,1,T,S], built once per step."""
    inputs = INPUTS[:6] + ["allowed5"]
    return helper.make_function(DOMAIN, MASKED_NAME, inputs, OUTPUTS, attention_nodes("allowed5"),
                                opset_imports=[helper.make_opsetid("", OPSET)], attributes=["scale"])
