"""The fused ONNX Runtime step graph (``fused_graph.py``) of a checkpoint too large to hold, layer by layer.

:class:`CheckpointWeights` is the fused writer's weight source for a safetensors checkpoint: it reads one decoder
layer at a time (fp32), quantizes its linear layers on the way when the recipe asks for block weights (every
one whose K is a multiple of 32, the LM head too, tied or not: as ``streamed.bind_weights`` does for the traced
graph), and the writer sends each initializer to the external weight file as it is made. The host holds one
layer (or the embedding) at a time; nothing is traced.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from ssd_trt.export.block_weights import BLOCK
from ssd_trt.export.fused_graph import TiedHead, write_fused_graph
from ssd_trt.export.onnx_export import WEIGHT_PREFIX
from ssd_trt.export.streamed import CHUNK_BYTES, Binding, ExternalWeights
from ssd_trt.models.checkpoint import Checkpoint
from ssd_trt.models.decoder import DecoderLayer, RMSNorm, rope_inverse_frequencies
from ssd_trt.models.gguf_blocks import BlockWeight

ATTENTION_OP = "GroupQueryAttention"


class CheckpointWeights:
    """``fused_graph.StepWeights`` read from ``checkpoint`` one layer at a time.

    ``keep_computed``: also keep, by graph weight name (the names ``streamed.reference_decoder`` takes), the
    float values the graph computes with (dequantized where quantized), for the bounded validation.
    ``file_blocks``: the checkpoint's own blocks (a GGUF file, ``weights: gguf``) instead of quantizing here;
    ``keep_8bit=False`` leaves its 8-bit blocks as their exact fp32 values (``block_weights.model_block_weights``
    says why: fp32 activations have no fast 8-bit kernel)."""

    def __init__(self, checkpoint: Checkpoint, bits: int | None, keep_computed: bool = False,
                 file_blocks: bool = False, keep_8bit: bool = True) -> None:
        self.checkpoint, self.bits, self.keep_computed = checkpoint, bits, keep_computed
        self.file_blocks, self.keep_8bit = file_blocks, keep_8bit
        self.config = checkpoint.config
        self.inv_freq = rope_inverse_frequencies(self.config)
        ids = checkpoint.tensors.get("lm_head_token_ids")
        self.head_token_ids = None if ids is None else checkpoint.tensor("lm_head_token_ids").numpy()
        self.binding = Binding(None)
        self._summary = {"layers": 0, "kinds": {}, "fp32_bytes_replaced": 0, "block_bytes": 0}
        if self.head_token_ids is not None and keep_computed:
            self.binding.computed[f"{WEIGHT_PREFIX}lm_head_token_ids"] = torch.from_numpy(self.head_token_ids)

    def _float(self, name: str) -> torch.Tensor:
        return self.checkpoint.tensor(name).float()

    def _keep(self, name: str, value: torch.Tensor) -> None:
        # no copy: every tensor here was read fresh from the checkpoint and nothing writes to it
        if self.keep_computed:
            self.binding.computed[WEIGHT_PREFIX + name] = value.detach()

    def embedding(self) -> torch.Tensor:
        weight = self._float("model.embed_tokens.weight")
        self._keep("embed_tokens.weight", weight)
        return weight

    def _embedding_again(self) -> torch.Tensor:
        """A tied head's weight: the kept embedding when there is one (a cut checkpoint: no second copy), else
        read again (a full model holds no embedding across its layers)."""
        kept = self.binding.computed.get(f"{WEIGHT_PREFIX}embed_tokens.weight")
        return kept if kept is not None else self._float("model.embed_tokens.weight")

    def layer(self, index: int) -> tuple[DecoderLayer, dict[str, BlockWeight]]:
        prefix = f"model.layers.{index}."
        state = {name[len(prefix):]: self._float(name) for name in self.checkpoint.tensors if name.startswith(prefix)}
        with torch.device("meta"):
            layer = DecoderLayer(self.config)
        layer.load_state_dict(state, strict=True, assign=True)
        blocks = {}
        for name, module in layer.named_modules():
            full = f"layers.{index}.{name}"
            if isinstance(module, nn.Linear):
                blocks.update(self._linear(full, module.weight.detach(), f"{prefix}{name}.weight"))
                if module.bias is not None:
                    self._keep(f"{full}.bias", module.bias.detach())
            elif isinstance(module, RMSNorm):
                self._keep(f"{full}.weight", module.weight.detach())
        return layer, blocks

    def head(self) -> tuple[RMSNorm, nn.Module, dict[str, BlockWeight]]:
        c = self.config
        norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        norm.weight = nn.Parameter(self._float("model.norm.weight"), requires_grad=False)
        self._keep("norm.weight", norm.weight)
        tied = c.tie_word_embeddings and c.head_vocab_size is None   # a tied head is the embedding matrix
        head = TiedHead(self._embedding_again() if tied else self._float("lm_head.weight"))
        return norm, head, self._linear("lm_head", head.weight, "model.embed_tokens.weight" if tied else "lm_head.weight")

    def _linear(self, name: str, weight: torch.Tensor, source: str) -> dict[str, BlockWeight]:
        """{name: blocks of W^T} when quantized (W [out, in], checkpoint tensor ``source``); keeps what the graph
        computes with."""
        if self.file_blocks:
            blocks = self.checkpoint.blocks(source)
            if blocks is None or (blocks.bits == 8 and not self.keep_8bit):
                self._keep(f"{name}.weight_t", weight.t())     # float in the file, or left as its exact values
                return {}
            computed = blocks.dequantize() if self.keep_computed else None
        elif self.bits is None or weight.shape[1] % BLOCK:
            self._keep(f"{name}.weight_t", weight.t())
            return {}
        else:
            blocks, computed = quantize_in_rows(weight.t().numpy(), self.bits, dequantized=self.keep_computed)
        if computed is not None:
            self._keep(f"{name}.weight_t", torch.from_numpy(computed))
        summary = self._summary
        summary["layers"] += 1
        summary["kinds"][blocks.kind] = summary["kinds"].get(blocks.kind, 0) + 1
        summary["fp32_bytes_replaced"] += weight.numel() * 4
        summary["block_bytes"] += blocks.values.size * blocks.bits // 8 + blocks.scales.nbytes + \
            (0 if blocks.offsets is None else blocks.offsets.nbytes)
        return {name: blocks}

    def quantization(self) -> dict | None:
        return dict(self._summary) if self.bits is not None or self.file_blocks else None


def quantize_in_rows(weight_t: np.ndarray, bits: int, dequantized: bool = False
                     ) -> tuple[BlockWeight, np.ndarray | None]:
    """``BlockWeight.quantize`` of W^T [K, N], ~``CHUNK_BYTES`` of fp32 rows at a time (blocks run along K, so
    row chunks that are multiples of 32 quantize exactly as the whole): a vocabulary-sized head stays bounded.
    With ``dequantized``, also the fp32 values the blocks stand for, filled chunk by chunk."""
    k, n = weight_t.shape
    rows = max(BLOCK, (CHUNK_BYTES // max(1, 4 * n)) // BLOCK * BLOCK)
    values = np.empty((k, n), np.int8)
    scales = np.empty((k // BLOCK, n), np.float32)
    computed = np.empty((k, n), np.float32) if dequantized else None
    for start in range(0, k, rows):
        part = BlockWeight.quantize(np.ascontiguousarray(weight_t[start:start + rows]), bits)
        values[start:start + rows], scales[start // BLOCK:(start + rows) // BLOCK] = part.values, part.scales
        if computed is not None:
            computed[start:start + rows] = part.dequantize()
    return BlockWeight(values, scales, None, bits, f"int{bits} (built)"), computed


def export_fused_streamed(checkpoint: Checkpoint, out_dir: Path, weights_file: str, bits: int | None,
                          max_positions: int, keep_computed: bool = False, file_blocks: bool = False,
                          keep_8bit: bool = True) -> tuple[onnx.ModelProto, Binding]:
    """The fused step graph of ``checkpoint`` with its weights in ``out_dir/weights_file`` (fp32, ``bits`` block
    weights, or the file's own blocks: :class:`CheckpointWeights`); returned unsaved (its tensors point at the
    weight file), with what binding did."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = CheckpointWeights(checkpoint, bits, keep_computed, file_blocks, keep_8bit)
    sink = ExternalWeights(out_dir / weights_file)
    try:
        graph = write_fused_graph(weights, max_positions, sink)
    finally:
        sink.close()
    attention = sum(node.op_type == ATTENTION_OP for node in graph.graph.node)
    if attention != checkpoint.config.num_layers:
        raise ValueError(f"the fused graph has {attention} attention nodes for {checkpoint.config.num_layers} layers")
    weights.binding.quantization = weights.quantization()
    return graph, weights.binding


def export_ort_graph(checkpoint: Checkpoint, out_dir: Path, bits: int | None, max_positions: int,
                     keep_computed: bool = False, file_blocks: bool = False, keep_8bit: bool = True
                     ) -> tuple[onnx.ModelProto, Binding, str]:
    """The ``ort`` flavour of a streamed model into ``out_dir/weights.bin``: the fused graph where it covers the
    model, else the traced one (``streamed.export_streamed``). The third value is "fused", or why not."""
    from ssd_trt.export.fused_graph import config_reason
    from ssd_trt.export.streamed import export_streamed
    reason = config_reason(checkpoint.config)
    if reason:
        if file_blocks:
            raise ValueError(f"weights: gguf keeps the file's blocks in the fused graph only, and this model needs the "
                             f"traced one ({reason}); use weights: int4 or int8")
        graph, binding = export_streamed(checkpoint, out_dir, "weights.bin", torch.float32, bits, keep_computed)
        return graph, binding, reason
    graph, binding = export_fused_streamed(checkpoint, out_dir, "weights.bin", bits, max_positions, keep_computed,
                                           file_blocks, keep_8bit)
    return graph, binding, "fused"
