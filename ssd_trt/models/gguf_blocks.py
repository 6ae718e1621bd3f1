"""Block-quantized weights: a GGUF file's blocks read as they are (no dequantisation), or a weight
quantized here (for a draft).

llama.cpp's block formats (ggml-common.h), 32 weights a block along the reduction dimension K:
  Q4_0  d: f16, 16 bytes of 4-bit q (low nibbles: weights 0-15, high nibbles: 16-31)   w = d (q - 8)
  Q4_1  d: f16, m: f16, the same 16 bytes                                              w = d q + m
  Q8_0  d: f16, 32 int8 q                                                               w = d q
Q4_1's minimum does not fit a symmetric zero point, but w = d (q - 8) + (m + 8 d) carries it exactly:
x W = x DQ(q - 8, d) + blocksums32(x) M' with M'[block, n] = m + 8 d. So every kind becomes symmetric
block-32 integers (what ONNX Runtime fuses into MatMulNBits and TensorRT takes as weight-only INT4/INT8)
plus, for Q4_1, a small per-block offset matrix.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 32
# GGUF tensor names of one decoder layer -> the project's Decoder module names
LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
KINDS = ("Q4_0", "Q4_1", "Q8_0")


@dataclass(frozen=True)
class BlockWeight:
    """A weight W [K, N] (y = x W) as symmetric block-32 integers along K: w = scale q (+ offset per block)."""
    values: np.ndarray              # int8 [K, N]: q in -8..7 (4 bits) or -128..127 (8 bits)
    scales: np.ndarray              # float32 [K/32, N]
    offsets: np.ndarray | None      # float32 [K/32, N] (Q4_1's m + 8 d), None for the symmetric kinds
    bits: int                       # 4 | 8
    kind: str                       # the GGUF type it came from

    def dequantize(self) -> np.ndarray:
        """W [K, N] float32, exactly as llama.cpp defines it (fp16 d, m widened to fp32)."""
        k, n = self.values.shape
        w = self.values.reshape(k // BLOCK, BLOCK, n).astype(np.float32) * self.scales[:, None, :]
        if self.offsets is not None:
            w = w + self.offsets[:, None, :]
        return w.reshape(k, n)

    @classmethod
    def quantize(cls, weight: np.ndarray, bits: int) -> "BlockWeight":
        """Round-to-nearest symmetric block-32 quantization of W [K, N] (scale = max |w| / qmax per block,
        as llama.cpp's Q8_0 / Q4_0 do): for a draft, whose exactness does not matter (any q is lossless)."""
        k, n = weight.shape
        if k % BLOCK:
            raise ValueError(f"a {bits}-bit weight needs K divisible by {BLOCK}, got {k}")
        qmax = 7 if bits == 4 else 127
        blocks = weight.reshape(k // BLOCK, BLOCK, n).astype(np.float32)
        scales = np.abs(blocks).max(axis=1) / qmax                                   # [K/32, N]
        safe = np.where(scales > 0, scales, 1.0)
        values = np.clip(np.rint(blocks / safe[:, None, :]), -qmax - (bits == 4), qmax).astype(np.int8)
        return cls(values.reshape(k, n), np.where(scales > 0, scales, np.float32(1e-8)).astype(np.float32), None,
                   bits, f"int{bits} (built)")

    def permute_columns(self, order: np.ndarray) -> "BlockWeight":
        """The same weight with its output columns (N) reordered (blocks run along K: they stay whole)."""
        return BlockWeight(self.values[:, order], self.scales[:, order],
                           None if self.offsets is None else self.offsets[:, order], self.bits, self.kind)


def parse_blocks(raw: np.ndarray, kind: str, k: int) -> BlockWeight:
    """``raw``: the GGUF tensor's bytes [N rows, bytes per row] (a row is one output's K weights)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, k // BLOCK, -1)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)      # [N, K/32]
    if kind == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).astype(np.int8)                    # [N, K/32, 32]
        return _block_weight(q, d, None, 8, kind)
    offset = 4 if kind == "Q4_1" else 2
    packed = blocks[..., offset:offset + 16]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8) - 8   # q - 8 in -8..7
    if kind == "Q4_0":
        return _block_weight(q, d, None, 4, kind)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return _block_weight(q, d, m + 8 * d, 4, kind)


def _block_weight(q: np.ndarray, d: np.ndarray, offsets: np.ndarray | None, bits: int, kind: str) -> BlockWeight:
    n, blocks, _ = q.shape
    values = np.ascontiguousarray(q.reshape(n, blocks * BLOCK).T)                   # [K, N]
    return BlockWeight(values, np.ascontiguousarray(d.T), None if offsets is None else np.ascontiguousarray(offsets.T),
                       bits, kind)


def read_block_weights(path: Path) -> dict[str, BlockWeight]:
    """The quantized 2-D weights of a GGUF file by Decoder parameter prefix (``layers.3.mlp.up_proj``,
    ``embed_tokens``, ``lm_head``). Tensors of other types (F32 norms, K-quants) are left out."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    out: dict[str, BlockWeight] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in KINDS or len(tensor.shape) != 2:
            continue
        name = _decoder_name(tensor.name)
        if name is not None:
            out[name] = parse_blocks(np.asarray(tensor.data), kind, int(tensor.shape[0]))
    return out


def _decoder_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "embed_tokens"
    if gguf_name == "output.weight":
        return "lm_head"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in LAYER_NAMES:
        return f"layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    return None


def rope_order(heads: int, head_dim: int) -> np.ndarray:
    """Column order that undoes llama.cpp's rotary permutation of q/k outputs: its converter stores each
    head's rows interleaved (pairs i, i + D/2 adjacent); the HF layout keeps the halves apart."""
    half = head_dim // 2
    h, j, i = np.meshgrid(np.arange(heads), np.arange(2), np.arange(half), indexing="ij")
    return (h * head_dim + 2 * i + j).reshape(-1)


def decoder_block_weights(path: Path, model) -> dict[str, BlockWeight]:
    """The GGUF's blocks for every linear layer of ``model`` (a Decoder loaded from the same file), by module
    name, the LM head included (a tied head reads the embedding's blocks), in the model's column order --
    checked: each dequantizes to exactly the weight the model holds, or the build stops here."""
    blocks = read_block_weights(path)
    config = model.config
    for name in [n for n in blocks if n.endswith(("q_proj", "k_proj"))]:
        heads = config.num_heads if name.endswith("q_proj") else config.num_kv_heads
        blocks[name] = blocks[name].permute_columns(rope_order(heads, config.head_dim))
    if "lm_head" not in blocks and model.lm_head is None and "embed_tokens" in blocks:
        blocks["lm_head"] = blocks["embed_tokens"]
    weights = dict(model.named_parameters())
    for name, block in blocks.items():
        held = (weights["embed_tokens.weight"] if name == "lm_head" and model.lm_head is None
                else weights[f"{name}.weight"]).detach().float().numpy().T
        if held.shape != block.values.shape or not np.array_equal(block.dequantize(), held):
            raise ValueError(f"{path}: the {block.kind} blocks of {name} do not dequantize to the weights "
                             f"transformers loaded from the same file; this GGUF layout is not supported")
    return blocks
