"""Block-quantized weights: a GGUF file's blocks read as they are (no dequantisation), or a weight
quantized here (for a draft).

llama.cpp's block formats (ggml-common.h; ``gguf.quants``' dequantize_blocks is the reference), along the
reduction dimension K. Each defines w = s q + M over integer codes q, a scale s and (some kinds) a minimum M:
  Q4_0  32 weights: d f16, 16 bytes of 4-bit q (low nibbles: weights 0-15, high: 16-31)      w = d (q - 8)
  Q4_1  32: d f16, m f16, the same 16 bytes                                                w = d q + m
  Q5_0  32: d f16, qh u32 (bit i: weight i's 5th bit), 16 bytes of low nibbles as Q4_0      w = d (q - 16)
  Q5_1  32: d f16, m f16, qh, the same 16 bytes                                            w = d q + m
  Q8_0  32: d f16, 32 int8 q                                                               w = d q
  Q4_K  256 = 8 sub-blocks of 32: d, dmin f16, 12 bytes of 6-bit (sc_j, m_j), 128 bytes of 4-bit q
                                                                       w = (d sc_j) q - (dmin m_j)
  Q5_K  256: as Q4_K plus 32 bytes qh (bit j of byte l: sub-block j's weight l's 5th bit)
                                                                       w = (d sc_j) q - (dmin m_j)
  Q6_K  256 = 16 sub-blocks of 16: 128 bytes low nibbles, 64 bytes high 2 bits, int8 sc_j, d f16
                                                                       w = (d sc_j) (q - 32)
A BlockWeight carries each as symmetric integers v (4 bits for 4-bit codes, else 8) with one fp32 scale per
``block`` weights along K (32; 16 for Q6_K) -- what ONNX Runtime fuses into MatMulNBits -- plus, for the kinds
with a minimum, a per-block offset O: w = s v + O, and x W = x DQ(v, s) + blocksums(x) O.

Exactness (dequantize() equals gguf.quants.dequantize bit for bit, and the graph's terms are the file's weights):
  * s v is exact in fp32 for every kind, as are ggml's d sc_j and dmin m_j: d has 11 significant bits, sc_j
    and m_j at most 7, v at most 6 beside a sc_j (8 in Q8_0, which has none) -- Q6_K's 2047 * 128 * 32 < 2^24.
  * Kinds with a minimum centre v = q - c (c = 2^(code bits - 1): 8 or 16), so O = c s + M. Then
    s v + O = s q + M in exact arithmetic, and fp32's s v + O is one rounding of that value -- ggml's
    d q + m, s q - dm is one rounding of the same value -- provided O itself is exact in fp32.
    O is computed in float64, where it is exact: every f16 value, so every d sc_j, dmin m_j and c s, is a
    multiple of 2^-24 below 2^26, so their sum needs at most 51 bits. It is exact in fp32 when c s and M lie
    within ~24 bits of each other; real files keep d and dmin within a factor ~16 (both Qwen2.5-Coder
    Q4_K_M files: all 43.7 M Q4_K offsets exact, research/real_pair/check_gguf_kinds.py), but nothing in
    the format forces it. So a tensor with any inexact O keeps its codes uncentred instead: v = q (0..31,
    8-bit) and O = M, exact as it stands (a 4-bit kind then costs 8 bits a weight; never seen in real files).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

BLOCK = 32
# GGUF tensor names of one decoder layer -> the project's Decoder module names
LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
FLOAT_KINDS = ("F32", "F16", "BF16", "F64")     # plain tensors (norms, biases): the model holds them as floats
# architectures whose q / k rows llama.cpp's converter interleaves ("norm" rope); qwen2 / qwen3 ("neox") keep HF's
PERMUTED_ROPE = ("llama", "mistral")

Codes = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]


@dataclass(frozen=True)
class BlockWeight:
    """A weight W [K, N] (y = x W) as symmetric integers along K, one scale per ``block`` of them:
    w = scale v (+ offset, one per block)."""
    values: np.ndarray              # int8 [K, N]: v in -8..7 (4 bits) or -128..127 (8 bits)
    scales: np.ndarray              # float32 [K/block, N]
    offsets: np.ndarray | None      # float32 [K/block, N] (c s + M of the kinds with a minimum), else None
    bits: int                       # 4 | 8
    kind: str                       # the GGUF type it came from
    block: int = BLOCK              # weights along K sharing a scale (and an offset): 32, or 16 (Q6_K)

    def __post_init__(self) -> None:
        k, n = self.values.shape
        if k % self.block or self.scales.shape != (k // self.block, n):
            raise ValueError(f"{self.kind}: scales {self.scales.shape} do not fit values {self.values.shape} "
                             f"in blocks of {self.block}")

    def dequantize(self) -> np.ndarray:
        """W [K, N] float32 as the graph's terms compute it, fp32 scale * v (+ offset): exactly llama.cpp's
        weights (module docstring)."""
        k, n = self.values.shape
        w = self.values.reshape(k // self.block, self.block, n).astype(np.float32)
        w *= self.scales[:, None, :]
        if self.offsets is not None:
            w += self.offsets[:, None, :]
        return w.reshape(k, n)

    @classmethod
    def quantize(cls, weight: np.ndarray, bits: int, block: int = BLOCK) -> "BlockWeight":
        """Round-to-nearest symmetric block quantization of W [K, N] (scale = max |w| / qmax per block,
        as llama.cpp's Q8_0 / Q4_0 do): for a draft, whose exactness does not matter (any q is lossless)."""
        k, n = weight.shape
        if k % block:
            raise ValueError(f"a {bits}-bit weight needs K divisible by {block}, got {k}")
        qmax = 7 if bits == 4 else 127
        blocks = weight.reshape(k // block, block, n).astype(np.float32)
        scales = np.abs(blocks).max(axis=1) / qmax                                   # [K/block, N]
        safe = np.where(scales > 0, scales, 1.0)
        values = np.clip(np.rint(blocks / safe[:, None, :]), -qmax - (bits == 4), qmax).astype(np.int8)
        return cls(values.reshape(k, n), np.where(scales > 0, scales, np.float32(1e-8)).astype(np.float32), None,
                   bits, f"int{bits} (built)", block)

    def permute_columns(self, order: np.ndarray) -> "BlockWeight":
        """The same weight with its output columns (N) reordered (blocks run along K: they stay whole)."""
        return BlockWeight(self.values[:, order], self.scales[:, order],
                           None if self.offsets is None else self.offsets[:, order], self.bits, self.kind, self.block)


# --- the GGUF layouts: each unpacks GGUF blocks uint8 [B, bytes] into (q int8 [B, weights],
#     s fp32 [B, weights / block], M fp32 [B, weights / block] or None) with w = s q + M

def _fields(packed: np.ndarray, run: int, bits: int) -> np.ndarray:
    """Bit fields of runs of ``run`` bytes: field j (bits j*bits...) of byte l of run r is weight
    (r * 8/bits + j) * run + l -- every ggml layout (Q4_0's nibbles: run 16; Q4_K's: run 32; qh bits: run 1 or 32)."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    fields = (packed.reshape(len(packed), -1, 1, run) >> shifts[:, None]) & np.uint8((1 << bits) - 1)
    return fields.reshape(len(packed), -1)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte ``at`` of each block, widened to fp32 [B, 1]."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def _scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 8 (sc, m) pairs of 6 bits from 12 bytes (ggml's get_scale_min_k4): bytes 0-3 hold sc_0..3
    (low 6 bits), 4-7 m_0..3, 8-11 the low nibbles of sc_4..7 and m_4..7; sc/m_4..7's top 2 bits are the top
    2 bits of bytes 0-3 / 4-7."""
    d, m, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_0(b: np.ndarray) -> Codes:
    return _fields(b[:, 2:18], 16, 4).astype(np.int8) - 8, _f16(b, 0), None


def _q4_1(b: np.ndarray) -> Codes:
    return _fields(b[:, 4:20], 16, 4).astype(np.int8), _f16(b, 0), _f16(b, 2)


def _q5_0(b: np.ndarray) -> Codes:
    q = _fields(b[:, 6:22], 16, 4) | (_fields(b[:, 2:6], 1, 1) << 4)
    return q.astype(np.int8) - 16, _f16(b, 0), None


def _q5_1(b: np.ndarray) -> Codes:
    return (_fields(b[:, 8:24], 16, 4) | (_fields(b[:, 4:8], 1, 1) << 4)).astype(np.int8), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> Codes:
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8), _f16(b, 0), None


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's per-32 scale d sc_j and minimum -(dmin m_j), both exact in fp32 (17-bit products)."""
    sc, mn = _scale_min(b[:, 4:16])
    return _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _q4_k(b: np.ndarray) -> Codes:
    return (_fields(b[:, 16:144], 32, 4).astype(np.int8), *_k_scales(b))


def _q5_k(b: np.ndarray) -> Codes:
    q = _fields(b[:, 48:176], 32, 4) | (_fields(b[:, 16:48], 32, 1) << 4)
    return (q.astype(np.int8), *_k_scales(b))


def _q6_k(b: np.ndarray) -> Codes:
    q = _fields(b[:, :128], 64, 4) | (_fields(b[:, 128:192], 32, 2) << 4)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return q.astype(np.int8) - 32, _f16(b, 208) * sc, None


@dataclass(frozen=True)
class Layout:
    """One GGUF block type: its bytes, and the integers it multiplies."""
    weights: int                    # weights of one GGUF block along K (a K-quant's super-block: 256)
    nbytes: int                     # bytes of one GGUF block
    code_bits: int                  # bits of each integer code q
    block: int                      # weights sharing a scale: BlockWeight.block
    unpack: Callable[[np.ndarray], Codes]


LAYOUTS = {"Q4_0": Layout(32, 18, 4, 32, _q4_0), "Q4_1": Layout(32, 20, 4, 32, _q4_1),
           "Q5_0": Layout(32, 22, 5, 32, _q5_0), "Q5_1": Layout(32, 24, 5, 32, _q5_1),
           "Q8_0": Layout(32, 34, 8, 32, _q8_0), "Q4_K": Layout(256, 144, 4, 32, _q4_k),
           "Q5_K": Layout(256, 176, 5, 32, _q5_k), "Q6_K": Layout(256, 210, 6, 16, _q6_k)}
KINDS = tuple(LAYOUTS)
WITH_MINIMUM = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")   # kinds whose blocks carry a per-block offset (the side term)


def parse_blocks(raw: np.ndarray, kind: str, k: int) -> BlockWeight:
    """``raw``: the GGUF tensor's bytes [N rows, bytes per row] (a row is one output's K weights)."""
    if kind not in LAYOUTS:
        raise ValueError(f"GGUF block type {kind} is not supported (supported: {', '.join(KINDS)})")
    layout = LAYOUTS[kind]
    n = raw.shape[0]
    if k % layout.weights or raw.size != n * (k // layout.weights) * layout.nbytes:
        raise ValueError(f"{kind}: {raw.shape} bytes are not {n} rows of K = {k} weights "
                         f"({layout.nbytes} bytes a {layout.weights}-weight block)")
    q, scale, minimum = layout.unpack(np.asarray(raw, dtype=np.uint8).reshape(-1, layout.nbytes))
    values, offsets, bits = _carried(q, scale, minimum, layout.code_bits)

    def k_by_n(rows: np.ndarray) -> np.ndarray:                 # [N * ..., ...] -> [K / ..., N]
        return np.ascontiguousarray(rows.reshape(n, -1).T)
    return BlockWeight(k_by_n(values), k_by_n(scale), None if offsets is None else k_by_n(offsets), bits, kind,
                       layout.block)


def _carried(q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None, code_bits: int
             ) -> tuple[np.ndarray, np.ndarray | None, int]:
    """(values, offsets, bits) for codes with w = s q + M: centred when every offset c s + M is exact in fp32,
    else uncentred 8-bit codes with offsets M (module docstring)."""
    bits = 4 if code_bits == 4 else 8
    if minimum is None:
        return q, None, bits
    center = 1 << (code_bits - 1)
    offsets = center * scale.astype(np.float64) + minimum          # exact: multiples of 2^-24 below 2^27
    if np.array_equal(offsets.astype(np.float32), offsets):
        return q - np.int8(center), offsets.astype(np.float32), bits
    return q, minimum, 8


def read_block_weights(path: Path) -> dict[str, BlockWeight]:
    """The quantized 2-D weights of a GGUF file by Decoder parameter prefix (``layers.3.mlp.up_proj``,
    ``embed_tokens``, ``lm_head``). Float tensors (norms, biases, an F16 weight) are left out; a decoder weight of
    a block type not in ``KINDS`` stops here (RecipeError naming it)."""
    import gguf

    from ssd_trt.errors import RecipeError
    reader = gguf.GGUFReader(str(path))
    out: dict[str, BlockWeight] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        name = _decoder_name(tensor.name)
        if name is None or kind in FLOAT_KINDS or len(tensor.shape) != 2:
            continue
        if kind not in KINDS:
            raise RecipeError(f"{path}: tensor {tensor.name} ({name}) is {kind}, a GGUF block type this build "
                              f"cannot carry (supported: {', '.join(KINDS)}); use weights: float, or a GGUF "
                              f"quantized to the supported types")
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
    import gguf
    blocks = read_block_weights(path)
    config = model.config
    architecture = gguf.GGUFReader(str(path)).fields["general.architecture"].contents()
    for name in [n for n in blocks if n.endswith(("q_proj", "k_proj")) and architecture in PERMUTED_ROPE]:
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
