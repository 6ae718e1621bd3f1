"""The step graph of a large checkpoint, written without ever holding the model: trace a skeleton, stream weights.

Tracing needs a model, not its weights. A *skeleton* decoder has every parameter as a zero-stride view of one
number (no memory), so the whole graph is traced from it with the parameters left as named graph inputs
(``onnx_export.trace_step_graph(weights_as_inputs=True)``). The weights are then bound one tensor at a time,
read lazily from the safetensors checkpoint (``models/checkpoint.py``) in column blocks, converted to the
flavour's type (or quantized to block-32 int4/int8 on the way: the ``DequantizeLinear -> MatMul`` pattern of
``block_weights.py``) and appended to the flavour's external weight file. The host holds one block of one
tensor at a time, whatever the model's size, and no graph ever nears protobuf's 2 GiB limit.

Checks stay real but bounded: the same code exports the checkpoint's first few layers at full width (the
embedding, the final norm and the head included), which is validated against the torch decoder in ONNX
Runtime and against transformers; the full graph's structure is checked (every weight bound with the shape the
config implies, one attention per layer). The manifest records exactly that scope.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto

from ssd_trt.export.block_weights import BLOCK, OPSET as BLOCK_OPSET, dequantize_into, pack_int4, set_default_opset
from ssd_trt.export.onnx_export import WEIGHT_PREFIX, trace_step_graph
from ssd_trt.models.checkpoint import Checkpoint
from ssd_trt.models.config import DecoderConfig
from ssd_trt.models.decoder import Decoder, rope_inverse_frequencies, with_named_weights
from ssd_trt.models.gguf_blocks import BlockWeight

ONNX_TYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
              torch.bfloat16: TensorProto.BFLOAT16, torch.int64: TensorProto.INT64}
ALIGNMENT = 4096            # every tensor starts on a page: ONNX Runtime can map it instead of copying
CHUNK_BYTES = 64 << 20      # fp32 bytes of one block of rows converted at a time


def skeleton(config: DecoderConfig, dtype: torch.dtype) -> Decoder:
    """A decoder with named weights (``with_named_weights``) whose parameters take no memory.

    Each parameter is a zero-stride view of its own one-element tensor holding a distinct small value, so the
    exporter neither merges equal parameters nor allocates them; only the rotary frequencies are real."""
    with torch.device("meta"):
        model = with_named_weights(Decoder(config))
    count = 0
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            count += 1
            value = torch.full((1,), count * 1e-6, dtype=dtype).expand(param.shape)
            setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta and name != "inv_freq":
                module.register_buffer(name, torch.zeros(buffer.shape, dtype=buffer.dtype))
    model.inv_freq = rope_inverse_frequencies(config)
    return model.eval()


def hf_name(graph_name: str, config: DecoderConfig) -> tuple[str, bool]:
    """The checkpoint tensor a graph weight comes from, and whether the graph holds it transposed."""
    name = graph_name.removeprefix(WEIGHT_PREFIX)
    transposed = name.endswith(".weight_t")
    name = name.removesuffix("_t")
    if name == "lm_head.weight" and config.tie_word_embeddings and config.head_vocab_size is None:
        return "model.embed_tokens.weight", transposed     # a tied head is a copy of the embedding
    return (name if name.startswith("lm_head") else f"model.{name}"), transposed


class ExternalWeights:
    """One external-data file, written tensor by tensor, each at a page-aligned offset."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.unlink(missing_ok=True)
        self.handle = open(path, "wb")
        self.size = 0

    def reserve(self, name: str, data_type: int, dims: tuple[int, ...], nbytes: int) -> tuple[TensorProto, int]:
        """A tensor proto pointing at ``nbytes`` reserved in the file, and the offset to write them at."""
        offset = -(-self.size // ALIGNMENT) * ALIGNMENT
        self.size = offset + nbytes
        tensor = TensorProto(name=name, data_type=data_type, dims=list(dims))
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(offset)), ("length", str(nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        return tensor, offset

    def write(self, offset: int, data: bytes) -> None:
        self.handle.seek(offset)
        self.handle.write(data)

    def store(self, name: str, data_type: int, dims: tuple[int, ...], data) -> TensorProto:
        """``data`` (bytes-like) written as one tensor; the proto that points at it."""
        tensor, offset = self.reserve(name, data_type, dims, len(data))
        self.write(offset, data)
        return tensor

    def close(self) -> None:
        self.handle.truncate(self.size)
        self.handle.close()


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@dataclass
class Binding:
    """What binding the weights did: the quantization summary and (when asked) the float weights the graph
    computes with, by graph weight name, for a torch reference."""
    quantization: dict | None
    computed: dict[str, torch.Tensor] = field(default_factory=dict)


def bind_weights(graph: onnx.ModelProto, checkpoint: Checkpoint, weights: ExternalWeights, dtype: torch.dtype,
                 bits: int | None, keep_computed: bool = False) -> Binding:
    """Turn each weight input of a skeleton trace into an initializer in ``weights``, read from ``checkpoint``.

    ``bits`` (4 or 8): every ``<module>.weight_t`` whose K is a multiple of 32 becomes symmetric block-32
    integers and their scales (the LM head too, tied or not: on a CPU its fp32 copy would cost as many bytes
    per token as the layers), read by a ``DequantizeLinear`` in front of its MatMul. Everything else is cast
    to ``dtype``. ``keep_computed`` keeps, per weight, the float values the graph computes with (dequantized
    ones for quantized weights): for the bounded validation, which must compare against what the graph does.
    """
    config = checkpoint.config
    consumers = {}
    for node in graph.graph.node:
        for index, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, index))
    binding = Binding(None)
    kinds, layers, before, after = {}, 0, 0, 0
    weight_inputs = [value for value in graph.graph.input if value.name.startswith(WEIGHT_PREFIX)]
    for value in weight_inputs:
        graph.graph.input.remove(value)
    for value in weight_inputs:
        name = value.name
        source, transposed = hf_name(name, config)
        info = checkpoint.tensors[source]
        shape = (info.shape[1], info.shape[0]) if transposed else info.shape
        declared = tuple(d.dim_value for d in value.type.tensor_type.shape.dim)
        if declared != tuple(shape):
            raise ValueError(f"graph weight {name} is {declared} but checkpoint tensor {source} gives {shape}")
        users = consumers.get(name, [])
        quantize = bits is not None and transposed and shape[0] % BLOCK == 0
        if quantize:
            if len(users) != 1 or users[0][0].op_type != "MatMul" or users[0][1] != 1:
                raise ValueError(f"{name}: expected one MatMul reading it as its second input")
            prefix = name.removeprefix(WEIGHT_PREFIX).removesuffix(".weight_t")
            after += _write_blocks(prefix, checkpoint, source, shape, bits, weights, graph, users[0][0], binding,
                                   keep_computed, name)
            before += int(np.prod(shape)) * 4
            layers += 1
            kinds[f"int{bits} (built)"] = kinds.get(f"int{bits} (built)", 0) + 1
        else:
            target = torch.int64 if info.dtype == "I64" else dtype
            write_float(name, checkpoint, source, shape, transposed, target, weights, graph, binding, keep_computed)
    if bits is not None:
        set_default_opset(graph, BLOCK_OPSET)
        binding.quantization = {"layers": layers, "kinds": kinds, "fp32_bytes_replaced": before, "block_bytes": after}
    return binding


def _row_blocks(checkpoint: Checkpoint, source: str, shape: tuple[int, ...], transposed: bool, width: int,
                whole: torch.Tensor | None = None):
    """The tensor as the graph holds it, in blocks of rows (multiples of 32 when possible), fp32-sized ~64 MB;
    the tensor itself is read once, in the checkpoint's dtype (``whole``: already read, e.g. one tensor-parallel
    rank's slice of it)."""
    whole = checkpoint.tensor(source) if whole is None else whole
    rows = max(BLOCK, (CHUNK_BYTES // max(1, 4 * width)) // BLOCK * BLOCK)
    for start in range(0, shape[0], rows):
        stop = min(shape[0], start + rows)
        # rows of W^T are columns of the checkpoint's [out, in] matrix
        yield whole[:, start:stop].t() if transposed else whole[start:stop]


def write_float(name, checkpoint, source, shape, transposed, dtype, weights, graph, binding, keep_computed,
                whole: torch.Tensor | None = None):
    """Checkpoint tensor ``source`` (or ``whole``, already read) as graph weight ``name`` of ``shape`` in ``dtype``:
    written to ``weights`` block of rows by block, its initializer appended to ``graph``."""
    width = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    element = torch.tensor([], dtype=dtype).element_size()
    tensor, offset = weights.reserve(name, ONNX_TYPES[dtype], shape, int(np.prod(shape)) * element)
    kept = []
    for block in (_row_blocks(checkpoint, source, shape, transposed, width, whole) if len(shape) > 1
                  else [checkpoint.tensor(source) if whole is None else whole]):
        block = block.to(dtype)
        weights.write(offset, _raw(block))
        offset += block.numel() * element
        if keep_computed:
            kept.append(block if dtype == torch.int64 else block.float())
    graph.graph.initializer.append(tensor)
    if keep_computed:
        binding.computed[name] = torch.cat(kept) if len(kept) > 1 else kept[0]


def _write_blocks(prefix, checkpoint, source, shape, bits, weights, graph, matmul, binding, keep_computed, name) -> int:
    """Quantize W^T [K, N] block of rows by block into ``<prefix>.q`` and ``<prefix>.scale``; returns their bytes."""
    k, n = shape
    q_bytes = k * n // 2 if bits == 4 else k * n
    q, q_offset = weights.reserve(f"{prefix}.q", TensorProto.INT4 if bits == 4 else TensorProto.INT8, shape, q_bytes)
    scale, s_offset = weights.reserve(f"{prefix}.scale", TensorProto.FLOAT, (k // BLOCK, n), k // BLOCK * n * 4)
    kept = []
    for block in _row_blocks(checkpoint, source, shape, True, n):
        quantized = BlockWeight.quantize(block.float().numpy(), bits)
        data = pack_int4(quantized.values) if bits == 4 else quantized.values.tobytes()
        weights.write(q_offset, data)
        q_offset += len(data)
        weights.write(s_offset, quantized.scales.tobytes())
        s_offset += quantized.scales.nbytes
        if keep_computed:
            kept.append(torch.from_numpy(quantized.dequantize()))
    position = list(graph.graph.node).index(matmul)
    graph.graph.node.insert(position, dequantize_into(prefix, matmul))
    graph.graph.initializer.extend([q, scale])
    if keep_computed:
        binding.computed[name] = torch.cat(kept)
    return q_bytes + k // BLOCK * n * 4


def export_streamed(checkpoint: Checkpoint, out_dir: Path, weights_file: str, dtype: torch.dtype,
                    bits: int | None = None, keep_computed: bool = False) -> tuple[onnx.ModelProto, Binding]:
    """The step graph of ``checkpoint`` with its weights in ``out_dir/weights_file`` (in ``dtype``, or quantized
    to ``bits``); the graph proto is returned unsaved (its tensors point at the weight file)."""
    graph = trace_step_graph(skeleton(checkpoint.config, dtype), weights_as_inputs=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = ExternalWeights(out_dir / weights_file)
    try:
        binding = bind_weights(graph, checkpoint, weights, dtype, bits, keep_computed)
    finally:
        weights.close()
    check_structure(graph, checkpoint.config)
    return graph, binding


def check_structure(graph: onnx.ModelProto, config: DecoderConfig) -> None:
    """The full graph, whose numbers are checked only on its first layers: one attention per layer and no weight
    left unbound (every bound one had the shape the config implies: ``bind_weights``)."""
    from ssd_trt_plugins.tree_attention.onnx_function import NAME
    attention = sum(node.op_type == NAME for node in graph.graph.node)
    if attention != config.num_layers:
        raise ValueError(f"the streamed graph has {attention} attention nodes for {config.num_layers} layers")
    unbound = [value.name for value in graph.graph.input if value.name.startswith(WEIGHT_PREFIX)]
    if unbound:
        raise ValueError(f"weights left unbound in the streamed graph: {unbound[:3]}")


def reference_decoder(config: DecoderConfig, computed: dict[str, torch.Tensor]) -> Decoder:
    """A torch decoder (named weights) computing with exactly the weights a streamed graph holds."""
    model = skeleton(config, torch.float32)
    state = {name.removeprefix(WEIGHT_PREFIX): tensor for name, tensor in computed.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if [m for m in missing if m != "inv_freq"] or unexpected:
        raise ValueError(f"reference weights do not fit the decoder: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()


LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def first_layers(checkpoint: Checkpoint, count: int) -> Checkpoint:
    """The checkpoint cut to its first ``count`` layers (embedding, final norm and head kept): the bounded check."""
    count = min(count, checkpoint.config.num_layers)
    layers = checkpoint.config.num_layers
    tensors = {name: info for name, info in checkpoint.tensors.items()
               if not (match := LAYER.match(name)) or int(match.group(1)) < count}
    hf = {key: (value[:count] if isinstance(value, list) and len(value) == layers and key != "eos_token_id" else value)
          for key, value in checkpoint.hf_config.items()}
    hf["num_hidden_layers"] = count
    # replace keeps the checkpoint's own class (a GGUF file's reader too)
    return dataclasses.replace(checkpoint, hf_config=hf, config=dataclasses.replace(checkpoint.config, num_layers=count),
                               tensors=tensors)


# the tensors whose rows are the vocabulary's tokens
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def first_tokens(checkpoint: Checkpoint, count: int) -> Checkpoint:
    """The checkpoint cut to the first ``count`` tokens of its vocabulary: the embedding's and the head's first
    rows, read as the full tensors' leading bytes (rows are contiguous in safetensors and GGUF alike). A bounded
    check's graph is written by the same code either way; at a 150k vocabulary the full rows' fp32 copies (torch
    reference, ONNX Runtime session, the dequantized head) were most of the build's peak memory. A reduced head
    (``lm_head_token_ids``) is left whole: its rows are not the first tokens."""
    config = checkpoint.config
    if count >= config.vocab_size or config.head_vocab_size is not None:
        return checkpoint
    tensors = dict(checkpoint.tensors)
    for name in VOCAB_TENSORS:
        if name in tensors:
            info = tensors[name]
            tensors[name] = dataclasses.replace(info, shape=(count, *info.shape[1:]),
                                                nbytes=info.nbytes // info.shape[0] * count)
    hf = {**checkpoint.hf_config, "vocab_size": count}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):     # special tokens past the cut are not in it
        ids = hf.get(key)
        if isinstance(ids, int) and ids >= count or isinstance(ids, list) and any(i >= count for i in ids):
            hf[key] = None
    return dataclasses.replace(checkpoint, hf_config=hf, config=dataclasses.replace(config, vocab_size=count),
                               tensors=tensors)

