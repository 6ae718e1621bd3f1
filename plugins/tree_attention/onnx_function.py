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


def tree_attention_function() -> onnx.FunctionProto:
    n = helper.make_node
    i64 = lambda v: np.array(v, dtype=np.int64)  # noqa: E731
    scale = n("Constant", [], ["scale_c"])
    scale.attribute.append(AttributeProto(name="value_float", ref_attr_name="scale", type=AttributeProto.FLOAT))
    nodes = [
        _const("zero", i64(0)), _const("one", i64(1)), _const("two", i64(2)), _const("c32", i64(32)),
        _const("two_pow_32", i64(2 ** 32)), _const("pow2", i64([2 ** j for j in range(32)])),
        _const("neg_inf", np.array(-np.inf, dtype=np.float32)),
        _const("ax0", i64([0])), _const("ax1", i64([1])), _const("ax2", i64([2])), _const("ax13", i64([1, 3])),
        _const("ax12", i64([1, 2])),
        scale,
        # shapes
        n("Shape", ["query"], ["B"], start=0, end=1), n("Shape", ["query"], ["T"], start=2, end=3),
        n("Shape", ["query"], ["D"], start=3, end=4), n("Shape", ["query"], ["Hq"], start=1, end=2),
        n("Shape", ["key_cache"], ["Hkv"], start=1, end=2), n("Shape", ["key_cache"], ["S"], start=2, end=3),
        n("Squeeze", ["T", "ax0"], ["T_s"]), n("Squeeze", ["S", "ax0"], ["S_s"]),
        # 1. write the new entries at slots L_b + t
        n("Cast", ["cache_lengths"], ["L"], to=TensorProto.INT64),
        n("Range", ["zero", "T_s", "one"], ["t_idx"]),
        n("Unsqueeze", ["L", "ax1"], ["L_col"]), n("Unsqueeze", ["t_idx", "ax0"], ["t_row"]),
        n("Add", ["L_col", "t_row"], ["slot"]),
        n("Unsqueeze", ["slot", "ax13"], ["slot4"]),
        n("Shape", ["key_new"], ["new_shape"]),
        n("Expand", ["slot4", "new_shape"], ["write_index"]),
        n("ScatterElements", ["key_cache", "write_index", "key_new"], ["key_cache_out"], axis=2),
        n("ScatterElements", ["value_cache", "write_index", "value_new"], ["value_cache_out"], axis=2),
        # 2. visibility mask [B, T, S]
        n("Range", ["zero", "S_s", "one"], ["slots"]),
        n("Unsqueeze", ["slots", "ax0"], ["slots_row"]),
        n("Sub", ["slots_row", "L_col"], ["rel"]),                       # slot - L_b, [B, S]
        n("Less", ["rel", "zero"], ["in_prefix"]),
        n("Less", ["rel", "T_s"], ["below_end"]), n("Not", ["in_prefix"], ["after_start"]),
        n("And", ["after_start", "below_end"], ["in_new"]),
        # unpack bit j of row i: word j // 32, bit j % 32 (int32 words read as unsigned)
        n("Div", ["t_idx", "c32"], ["word_idx"]), n("Mod", ["t_idx", "c32"], ["bit_idx"]),
        n("Gather", ["tree_mask", "word_idx"], ["words"], axis=2),
        n("Cast", ["words"], ["words64"], to=TensorProto.INT64),
        n("Less", ["words64", "zero"], ["negative"]),
        n("Add", ["words64", "two_pow_32"], ["words_wrapped"]),
        n("Where", ["negative", "words_wrapped", "words64"], ["unsigned"]),
        n("Gather", ["pow2", "bit_idx"], ["bit_weight"]),
        n("Div", ["unsigned", "bit_weight"], ["shifted"]), n("Mod", ["shifted", "two"], ["bit"]),
        n("Cast", ["bit"], ["new_bits"], to=TensorProto.BOOL),               # [B, T, T]
        n("Sub", ["T_s", "one"], ["T_last"]),
        n("Max", ["rel", "zero"], ["rel_lo"]), n("Min", ["rel_lo", "T_last"], ["rel_clipped"]),
        n("Unsqueeze", ["rel_clipped", "ax1"], ["rel_b1s"]),
        n("Concat", ["B", "T", "S"], ["bts"], axis=0),
        n("Expand", ["rel_b1s", "bts"], ["rel_bts"]),
        n("GatherElements", ["new_bits", "rel_bts"], ["tree_part"], axis=2),
        n("Unsqueeze", ["in_new", "ax1"], ["in_new_b1s"]), n("Unsqueeze", ["in_prefix", "ax1"], ["in_prefix_b1s"]),
        n("And", ["in_new_b1s", "tree_part"], ["new_visible"]),
        n("Or", ["in_prefix_b1s", "new_visible"], ["allowed"]),
        n("Unsqueeze", ["allowed", "ax12"], ["allowed5"]),                   # [B, 1, 1, T, S]
        # 3. grouped-query attention
        n("Div", ["Hq", "Hkv"], ["G"]),
        n("Concat", ["B", "Hkv", "G", "T", "D"], ["q5_shape"], axis=0),
        n("Reshape", ["query", "q5_shape"], ["q5"]),
        n("Unsqueeze", ["key_cache_out", "ax2"], ["k5"]), n("Unsqueeze", ["value_cache_out", "ax2"], ["v5"]),
        n("Transpose", ["k5"], ["k5_t"], perm=[0, 1, 2, 4, 3]),
        n("MatMul", ["q5", "k5_t"], ["scores"]),
        n("Mul", ["scores", "scale_c"], ["scaled"]),
        n("Where", ["allowed5", "scaled", "neg_inf"], ["masked"]),
        n("Softmax", ["masked"], ["probs"], axis=-1),
        n("MatMul", ["probs", "v5"], ["out5"]),
        n("Shape", ["query"], ["q_shape"]),
        n("Reshape", ["out5", "q_shape"], ["output"]),
    ]
    return helper.make_function(DOMAIN, NAME, INPUTS, OUTPUTS, nodes,
                                opset_imports=[helper.make_opsetid("", OPSET)], attributes=["scale"])
