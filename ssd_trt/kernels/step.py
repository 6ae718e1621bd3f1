"""A whole decoder step in the kernel library (``csrc/ssd_step.h``): the model's tiles and floats as the C structures
read them, and one call per step over the engine's KV buffers."""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from ssd_trt.kernels.artifact import CpuTiles
from ssd_trt.kernels.native import Kernels, NativeWeight, _Weight

_p, _f = ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _p), ("mlp_norm", _p), *[(name, ctypes.POINTER(_Weight)) for name in
                                                        ("q", "k", "v", "o", "gate", "up", "down")],
                ("q_bias", _p), ("k_bias", _p), ("v_bias", _p), ("q_norm", _p), ("k_norm", _p)]


class _Model(ctypes.Structure):
    _fields_ = [*[(name, ctypes.c_int32) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                                      "intermediate", "vocab", "positions")],
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cos", _p), ("sin", _p),
                ("embed", ctypes.POINTER(_Weight)), ("head", ctypes.POINTER(_Weight)), ("final_norm", _p),
                ("layer", ctypes.POINTER(_Layer))]


class _StepArgs(ctypes.Structure):
    _fields_ = [*[(name, ctypes.c_int32) for name in ("batch", "tokens", "mask_words", "logits_per_row",
                                                      "capacity")],
                ("input_ids", _p), ("positions", _p), ("mask", _p), ("lengths", _p), ("logit_indices", _p),
                ("keys", ctypes.POINTER(_p)), ("values", ctypes.POINTER(_p)), ("logits", _p)]


class ModelStep:
    """One model's step over its tiles (``artifact.load_cpu_tiles``); any pool may run it (:meth:`run`)."""

    def __init__(self, tiles: CpuTiles) -> None:
        s = tiles.shape
        self.tiles = tiles
        self.layers, self.vocab, self.positions = s["num_layers"], s["vocab_size"], tiles.index["positions"]
        self._weights: dict[str, NativeWeight] = {}
        self._keep: list[object] = []          # every array the structures point into

        def weight(name: str):
            if name not in self._weights:
                self._weights[name] = NativeWeight(tiles.weight(name))
            return ctypes.pointer(self._weights[name].struct)

        def floats(name: str) -> int | None:
            values = tiles.floats(name)
            if values is None:
                return None
            self._keep.append(values)
            return values.ctypes.data

        self.embed = NativeWeight(tiles.weight("embed"))
        self._weights["embed"] = self.embed
        layers = (_Layer * self.layers)()
        for i in range(self.layers):
            p = f"layers.{i}"
            layers[i] = _Layer(floats(f"{p}.attn_norm"), floats(f"{p}.mlp_norm"),
                               *[weight(f"{p}.{name}") for name in ("q", "k", "v", "o", "gate", "up", "down")],
                               *[floats(f"{p}.{name}") for name in ("q_bias", "k_bias", "v_bias", "q_norm",
                                                                     "k_norm")])
        self._layers = layers
        self.struct = _Model(s["num_layers"], s["hidden_size"], s["num_heads"], s["num_kv_heads"], s["head_dim"],
                             s["intermediate_size"], s["vocab_size"], self.positions, tiles.index["rms_norm_eps"],
                             s["head_dim"] ** -0.5, floats("cos"), floats("sin"), weight("embed"),
                             weight("head" if tiles.has("head") else "embed"), floats("final_norm"), layers)

    @property
    def nbytes(self) -> int:
        return int(self.tiles.data.nbytes)

    def run(self, kernels: Kernels, input_ids: np.ndarray, positions: np.ndarray, packed_mask: np.ndarray,
            lengths: np.ndarray, logit_indices: np.ndarray, keys: Sequence[int], values: Sequence[int],
            capacity: int, logits: np.ndarray) -> None:
        """One step: ``input_ids`` / ``positions`` int64 [B, T], ``packed_mask`` int32 [B, T, W], ``lengths`` int32
        [B], ``logit_indices`` int64 [B, L], ``keys`` / ``values``: each layer's cache address at the step's first
        row ([rows, kv_heads, capacity, head_dim] float32), ``logits`` float32 [B, L, V] (written)."""
        batch, tokens = input_ids.shape
        arrays = [np.ascontiguousarray(a, dtype=t) for a, t in ((input_ids, np.int64), (positions, np.int64),
                                                                  (packed_mask, np.int32), (lengths, np.int32),
                                                                  (logit_indices, np.int64))]
        ids, pos, mask, lens, picks = arrays
        if ids.min() < 0 or ids.max() >= self.vocab:
            raise ValueError(f"token ids must lie in [0, {self.vocab}), got {int(ids.min())}..{int(ids.max())}")
        if pos.min() < 0 or pos.max() >= self.positions:
            raise ValueError(f"positions must lie in [0, {self.positions}), got {int(pos.min())}..{int(pos.max())}")
        if picks.size and (picks.min() < 0 or picks.max() >= tokens):
            raise ValueError(f"logit indices must lie in [0, {tokens})")
        if mask.shape[:2] != (batch, tokens) or mask.shape[2] != -(-tokens // 32):
            raise ValueError(f"the packed mask must be [{batch}, {tokens}, {-(-tokens // 32)}], got {mask.shape}")
        if logits.shape != (batch, picks.shape[1], self.vocab) or logits.dtype != np.float32 \
                or not logits.flags.c_contiguous:
            raise ValueError(f"logits must be float32 C-contiguous [{batch}, {picks.shape[1]}, {self.vocab}]")
        pointers = _p * self.layers
        args = _StepArgs(batch, tokens, mask.shape[2], picks.shape[1], capacity, ids.ctypes.data, pos.ctypes.data,
                         mask.ctypes.data, lens.ctypes.data, picks.ctypes.data, pointers(*keys), pointers(*values),
                         logits.ctypes.data)
        kernels.run_step(self.struct, args)
