"""GGUF blocks repacked into the kernel's column tiles (``csrc/ssd_kernels.h`` describes the layout), no value changed.

A GGUF tensor stores each output column's K weights as a row of blocks (``models/gguf_blocks.py`` lists the kinds).
The kernel wants 16 columns side by side so that one SIMD register holds 4 consecutive k of each of the 16: the
repack moves the file's integer codes into that order and keeps its scale fields as the file has them -- f16 d
(and m, dmin), Q4_K / Q5_K's 6-bit sc and m widened to a byte each, Q6_K's int8 sc -- so a tile costs the file's
bits a weight (Q4_K 4.625 against the file's 4.5: the 6-bit scales take a byte). Codes are unsigned: Q8_0's q is
stored as q + 128, and every kind's w = s u + m holds exactly (s, m in ``csrc/layout.h``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ssd_trt.models.gguf_blocks import LAYOUTS, _fields, _scale_min

TILE = 16
SUB = 32
GGML_TYPE = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
CODE_BYTES = {4: 256, 5: 320, 6: 384, 8: 512}         # one sub-block's codes for 16 columns
SCALE_BYTES = {"Q4_0": 32, "Q5_0": 32, "Q8_0": 32, "Q4_1": 64, "Q5_1": 64, "Q4_K": 320, "Q5_K": 320, "Q6_K": 288}
KINDS = tuple(GGML_TYPE)


def kblock(kind: str) -> int:
    """Weights along K of one stored block (a K-quant's super-block: 256)."""
    return LAYOUTS[kind].weights


def tile_bytes(kind: str, k: int) -> int:
    """Bytes of one 16-column tile (``ssd_tile_bytes``)."""
    per_block = SCALE_BYTES[kind] + kblock(kind) // SUB * CODE_BYTES[LAYOUTS[kind].code_bits]
    return k // kblock(kind) * per_block


@dataclass(frozen=True)
class TiledWeight:
    """W [K, N] (y = x W) as the kernel reads it: ceil(N / 16) tiles of ``tile_bytes(kind, k)`` bytes."""
    kind: str
    k: int
    n: int
    tiles: np.ndarray          # uint8, 1-D

    @property
    def nbytes(self) -> int:
        return int(self.tiles.nbytes)


def _f16_bits(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte ``at`` of each block, as its 16 bits [B]."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.uint16)[:, 0]


def _decode(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """GGUF blocks uint8 [B, bytes] -> (unsigned codes uint8 [B, weights], the scale fields as the tile stores
    them, each [B, ...] of one block)."""
    b = blocks
    if kind == "Q4_0":
        return _fields(b[:, 2:18], 16, 4), [_f16_bits(b, 0)]
    if kind == "Q4_1":
        return _fields(b[:, 4:20], 16, 4), [_f16_bits(b, 0), _f16_bits(b, 2)]
    if kind == "Q5_0":
        return _fields(b[:, 6:22], 16, 4) | (_fields(b[:, 2:6], 1, 1) << 4), [_f16_bits(b, 0)]
    if kind == "Q5_1":
        return _fields(b[:, 8:24], 16, 4) | (_fields(b[:, 4:8], 1, 1) << 4), [_f16_bits(b, 0), _f16_bits(b, 2)]
    if kind == "Q8_0":
        return np.ascontiguousarray(b[:, 2:34]) ^ np.uint8(0x80), [_f16_bits(b, 0)]     # q + 128
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = _scale_min(b[:, 4:16])
        codes = _fields(b[:, 16:144], 32, 4) if kind == "Q4_K" else \
            _fields(b[:, 48:176], 32, 4) | (_fields(b[:, 16:48], 32, 1) << 4)
        return codes, [_f16_bits(b, 0), _f16_bits(b, 2), sc.astype(np.uint8), mn.astype(np.uint8)]
    if kind == "Q6_K":
        codes = _fields(b[:, :128], 64, 4) | (_fields(b[:, 128:192], 32, 2) << 4)
        return codes, [_f16_bits(b, 208), np.ascontiguousarray(b[:, 192:208])]
    raise ValueError(f"the kernel reads {', '.join(KINDS)}, not {kind}")


def _group_bytes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [T, KB, subs, 16 columns, 32 k] -> one sub-block's bytes [T, KB, subs, CODE_BYTES]."""
    t, kb, subs = codes.shape[:3]
    # group g: 4 consecutive k of every column, column c's at bytes 4c .. 4c+3
    groups = codes.reshape(t, kb, subs, TILE, 8, 4).transpose(0, 1, 2, 4, 3, 5).reshape(t, kb, subs, 8, 64)
    if bits == 8:
        return groups.reshape(t, kb, subs, 512)
    low = groups & np.uint8(0x0F)
    parts = [low[:, :, :, 0::2] | (low[:, :, :, 1::2] << 4)]                       # 4 chunks of 64
    if bits == 5:
        parts.append(np.packbits((groups >> 4) & 1, axis=-1, bitorder="little"))   # 8 words of 64 bits
    elif bits == 6:
        top = (groups >> 4) & np.uint8(3)
        parts.append(top[:, :, :, 0::4] | (top[:, :, :, 1::4] << 2) | (top[:, :, :, 2::4] << 4)
                     | (top[:, :, :, 3::4] << 6))                                   # 2 chunks of 64
    return np.concatenate([p.reshape(t, kb, subs, -1) for p in parts], axis=-1)


def tile_gguf(raw: np.ndarray, kind: str, k: int) -> TiledWeight:
    """The tiles of a GGUF tensor: ``raw`` its bytes [N rows, bytes a row] (row n: output n's K weights, in the
    order the model wants its columns)."""
    if kind not in GGML_TYPE:
        raise ValueError(f"the kernel reads {', '.join(KINDS)}, not {kind}")
    layout = LAYOUTS[kind]
    n = raw.shape[0]
    if k % layout.weights or np.asarray(raw).size != n * (k // layout.weights) * layout.nbytes:
        raise ValueError(f"{kind}: {np.shape(raw)} bytes are not {n} rows of K = {k} weights")
    kb = k // layout.weights
    padded = -(-n // TILE) * TILE
    blocks = np.zeros((padded * kb, layout.nbytes), np.uint8)           # padding columns: all-zero blocks, w = 0
    blocks[:n * kb] = np.asarray(raw, np.uint8).reshape(n * kb, layout.nbytes)
    codes, fields = _decode(blocks, kind)
    t, subs = padded // TILE, layout.weights // SUB
    # [T, 16, KB, ...] -> [T, KB, ...field, 16]: each field's 16 columns side by side
    # each field [T, 16 columns, KB, ...] -> [T, KB, ..., 16]: its 16 columns side by side, as bytes
    scales = np.concatenate([np.ascontiguousarray(np.moveaxis(f.reshape(t, TILE, kb, *f.shape[1:]), 1, -1))
                             .view(np.uint8).reshape(t, kb, -1) for f in fields], axis=-1)
    assert scales.shape[-1] == SCALE_BYTES[kind], (kind, scales.shape)
    code_blocks = codes.reshape(t, TILE, kb, subs, SUB).transpose(0, 2, 3, 1, 4)
    code_bytes = _group_bytes(np.ascontiguousarray(code_blocks), LAYOUTS[kind].code_bits).reshape(t, kb, -1)
    tiles = np.concatenate([scales, code_bytes], axis=-1).reshape(-1)
    assert tiles.size == t * tile_bytes(kind, k)
    return TiledWeight(kind, k, n, np.ascontiguousarray(tiles))
