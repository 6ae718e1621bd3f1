"""Weights as the model ships them: each linear layer of the traced step graph reads the GGUF's own blocks.

The traced graph computes ``x @ <module>.weight_t`` for every linear layer (``models/decoder.py``,
``TransposedLinear``). Here each such weight with quantized blocks (``models/gguf_blocks.py``) becomes

    DequantizeLinear(q: INT4 or INT8 [K, N], scale [K/B, N], axis=0, block_size=B) -> MatMul

(B = 32, or 16 for Q6_K) the pattern ONNX Runtime's CPU provider fuses into one ``MatMulNBits`` node and
TensorRT reads as weight-only INT4/INT8 (symmetric: zero point 0). The minimum of Q4_1, Q5_1, Q4_K, Q5_K rides
along exactly as a second, small MatMul of the B-wide block sums of x: x W = x DQ(v, s) + blocksums_B(x) O
(see gguf_blocks.py). Nothing is re-quantized: the integers and scales are the file's.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ssd_trt.export.onnx_export import WEIGHT_PREFIX
from ssd_trt.models.gguf_blocks import BLOCK, BlockWeight

OPSET = 21            # DequantizeLinear's block_size and the INT4 type
WEIGHT_SUFFIX = ".weight_t"


def apply_block_weights(model: onnx.ModelProto, blocks: dict[str, BlockWeight]) -> tuple[onnx.ModelProto, dict]:
    """Replace each ``<prefix>.weight_t`` initializer that ``blocks`` has with its blocks (in place);
    returns the model and a summary (which layers, which kinds, bytes before and after)."""
    initializers = {init.name: init for init in model.graph.initializer}
    users = {}
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            if name.endswith(WEIGHT_SUFFIX) and name in initializers:
                users.setdefault(name, []).append((node, index))
    replaced, kinds, before, after = [], {}, 0, 0
    for name, nodes_using in users.items():
        prefix = name[:-len(WEIGHT_SUFFIX)].removeprefix(WEIGHT_PREFIX)
        if prefix not in blocks:
            continue
        weight = blocks[prefix]
        shape = tuple(initializers[name].dims)
        if shape != weight.values.shape:
            raise ValueError(f"{prefix}: the graph's weight is {shape} but the GGUF blocks are {weight.values.shape}")
        if len(nodes_using) != 1 or nodes_using[0][0].op_type != "MatMul" or nodes_using[0][1] != 1:
            raise ValueError(f"{prefix}: expected one MatMul reading {name} as its second input")
        matmul = nodes_using[0][0]
        ahead, behind, inits = block_matmul(prefix, matmul, weight)
        position = list(model.graph.node).index(matmul)     # topological order: ahead, the MatMul, behind
        for offset, node in enumerate(ahead):
            model.graph.node.insert(position + offset, node)
        for offset, node in enumerate(behind, start=position + len(ahead) + 1):
            model.graph.node.insert(offset, node)
        model.graph.initializer.remove(initializers[name])
        model.graph.initializer.extend(inits)
        before += int(np.prod(shape)) * 4
        after += sum(_bytes(init) for init in inits)
        replaced.append(prefix)
        kinds[weight.kind] = kinds.get(weight.kind, 0) + 1
    set_default_opset(model, OPSET)
    return model, {"layers": len(replaced), "kinds": kinds, "fp32_bytes_replaced": before, "block_bytes": after}


def block_matmul(prefix: str, matmul: onnx.NodeProto, weight: BlockWeight
                  ) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Nodes to put before ``matmul`` (the dequantized weight, rewired into it), nodes to put after it (the
    offset term of a kind with a minimum, added to its output), and their initializers."""
    k, n = weight.values.shape
    block = weight.block
    if weight.bits == 4:
        q = int4_tensor(f"{prefix}.q", weight.values)
    else:
        q = numpy_helper.from_array(weight.values.astype(np.int8), f"{prefix}.q")
    inits = [q, numpy_helper.from_array(weight.scales.astype(np.float32), f"{prefix}.scale")]
    ahead = [dequantize_into(prefix, matmul, block)]
    if weight.offsets is None:
        return ahead, [], inits
    # x W = x DQ + blocksums_B(x) O: sum x over each block of B inputs, then a [K/B, N] MatMul
    x, out, main = matmul.input[0], matmul.output[0], f"{prefix}.main"
    matmul.output[0] = main
    inits += [numpy_helper.from_array(weight.offsets.astype(np.float32), f"{prefix}.offsets"),
              numpy_helper.from_array(np.array([0, 0, k // block, block], dtype=np.int64), f"{prefix}.blocks_shape"),
              numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{prefix}.last_axis")]
    ahead += [helper.make_node("Reshape", [x, f"{prefix}.blocks_shape"], [f"{prefix}.x_blocks"]),
              helper.make_node("ReduceSum", [f"{prefix}.x_blocks", f"{prefix}.last_axis"], [f"{prefix}.block_sums"],
                               keepdims=0),
              helper.make_node("MatMul", [f"{prefix}.block_sums", f"{prefix}.offsets"], [f"{prefix}.offset_term"])]
    return ahead, [helper.make_node("Add", [main, f"{prefix}.offset_term"], [out], name=f"{prefix}.add_offsets")], inits


def dequantize_into(prefix: str, matmul: onnx.NodeProto, block: int = BLOCK) -> onnx.NodeProto:
    """The DequantizeLinear of ``<prefix>.q`` / ``<prefix>.scale`` (symmetric, blocks of ``block`` along K),
    rewired into ``matmul`` as its weight: the node to put ahead of it."""
    matmul.input[1] = f"{prefix}.w"
    return helper.make_node("DequantizeLinear", [f"{prefix}.q", f"{prefix}.scale"], [f"{prefix}.w"], axis=0,
                            block_size=block, name=f"{prefix}.dequantize")


def pack_int4(values: np.ndarray) -> bytes:
    """int8 values in -8..7 packed as ONNX stores INT4: two a byte, the first in the low nibble (row-major)."""
    # two's complement: an int8 value's low nibble, read as a byte, is its 4-bit code (-1 -> 0xF)
    flat = np.ascontiguousarray(values, dtype=np.int8).reshape(-1).view(np.uint8) & 0x0F
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] | (flat[1::2] << 4)).tobytes()


def int4_tensor(name: str, values: np.ndarray) -> onnx.TensorProto:
    """An INT4 initializer from int8 values in -8..7 (:func:`pack_int4`)."""
    tensor = TensorProto(name=name, data_type=TensorProto.INT4, dims=list(values.shape))
    tensor.raw_data = pack_int4(values)
    return tensor


def _bytes(init: onnx.TensorProto) -> int:
    if init.data_type == TensorProto.INT4:
        return (int(np.prod(init.dims)) + 1) // 2
    return numpy_helper.to_array(init).nbytes


def set_default_opset(model: onnx.ModelProto, version: int) -> None:
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version < version:
            opset.version = version


def model_block_weights(weights: str, source, model, keep_8bit: bool = True) -> dict[str, BlockWeight] | None:
    """The block weights a recipe asks for (``ModelSpec.weights``), by Decoder module name; None for float.

    ``keep_8bit=False`` leaves 8-bit blocks (a GGUF's Q8_0 LM head; Q5_*, Q6_K) as fp32 weights -- their exact
    dequantization: ONNX Runtime's fused 8-bit MatMul with fp32 activations has no fast kernel (the
    SmolLM2 head took 123 ms a token that way, against ~9 ms for the fp32 matrix), while with int8
    activations it is the fastest form (3 ms).

    ``gguf``: the source file's own blocks (checked to dequantize to exactly the model's weights).
    ``int8`` / ``int4``: each linear layer (and an untied LM head) quantized here, block-32 symmetric; the
    model's weights are replaced by their dequantized values, so the torch model that validates the graph
    computes what the graph does.
    """
    import torch
    from torch import nn

    from ssd_trt.errors import RecipeError
    from ssd_trt.models.gguf_blocks import decoder_block_weights
    if weights == "float":
        return None
    if weights == "gguf":
        if source.kind != "gguf":
            raise RecipeError(f"weights: gguf keeps a GGUF file's own blocks, but {source.path} is not a .gguf "
                              f"file; use weights: float, int8 or int4 for this model")
        blocks = decoder_block_weights(source.path, model)
        return {name: b for name, b in blocks.items() if keep_8bit or b.bits != 8}
    bits = built_bits(weights, keep_8bit)
    blocks = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.in_features % BLOCK == 0:
            block = BlockWeight.quantize(module.weight.detach().float().numpy().T, bits)
            with torch.no_grad():
                module.weight.copy_(torch.from_numpy(np.ascontiguousarray(block.dequantize().T)))
            blocks[name] = block
    return blocks


def built_bits(weights: str, keep_8bit: bool) -> int | None:
    """The bits of a recipe's block weights quantized at build (``int8`` / ``int4``), None otherwise; refuses
    int8 weights without int8 activations (``keep_8bit``)."""
    if weights not in ("int8", "int4"):
        return None
    if weights == "int8" and not keep_8bit:
        from ssd_trt.errors import RecipeError
        raise RecipeError("weights: int8 needs activations: int8 for the same model (ONNX Runtime's 8-bit MatMul "
                          "with fp32 activations is slower than fp32 weights); or use weights: int4")
    return 8 if weights == "int8" else 4
