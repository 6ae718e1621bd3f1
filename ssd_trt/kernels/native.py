"""The Python face of the kernel library (ctypes): a pool of threads on one instruction-set path, weights held as
tiles, and y = x W for float activations x [M, K] -- quantized here to int8 per block of 32 as llama.cpp does."""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import numpy as np

from ssd_trt.kernels.build import KernelBuildError, library_path
from ssd_trt.kernels.tiles import GGML_TYPE, SUB, TILE, TiledWeight, tile_bytes

PATHS = ("avx512vnni", "avx2", "scalar")      # best first
DEFAULT_SPIN_US = 200


class _Weight(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("k", ctypes.c_int32), ("n", ctypes.c_int32),
                ("reserved", ctypes.c_int32), ("tiles", ctypes.c_void_p)]


class _Act(ctypes.Structure):
    _fields_ = [("m", ctypes.c_int32), ("k", ctypes.c_int32), ("q", ctypes.c_void_p), ("d", ctypes.c_void_p),
                ("ds", ctypes.c_void_p), ("ds16", ctypes.c_void_p)]


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.ssd_tile_bytes.restype, lib.ssd_tile_bytes.argtypes = ctypes.c_size_t, [i, i]
    lib.ssd_cpu_features.restype, lib.ssd_cpu_features.argtypes = i, []
    lib.ssd_isa_find.restype, lib.ssd_isa_find.argtypes = p, [ctypes.c_char_p]
    lib.ssd_pool_create.restype, lib.ssd_pool_create.argtypes = p, [p, i, p, i]
    lib.ssd_pool_destroy.restype, lib.ssd_pool_destroy.argtypes = None, [p]
    lib.ssd_pool_path.restype, lib.ssd_pool_path.argtypes = ctypes.c_char_p, [p]
    lib.ssd_quantize.restype, lib.ssd_quantize.argtypes = None, [p, p, i64, p]
    lib.ssd_matmul.restype, lib.ssd_matmul.argtypes = None, [p, i, p, p, p, i64, p]
    lib.ssd_dequantize.restype, lib.ssd_dequantize.argtypes = None, [p, p, i64]
    lib.ssd_matmul_each.restype, lib.ssd_matmul_each.argtypes = None, [p, i, p, p, p, p]
    lib.ssd_dequantize_column.restype, lib.ssd_dequantize_column.argtypes = None, [p, i, p]
    lib.ssd_step.restype, lib.ssd_step.argtypes = i, [p, p, p]
    return lib


class NativeWeight:
    """A tiled weight as the library reads it (the numpy tiles stay alive with it)."""

    def __init__(self, weight: TiledWeight) -> None:
        if weight.tiles.size != -(-weight.n // TILE) * tile_bytes(weight.kind, weight.k):
            raise ValueError(f"{weight.kind} [{weight.k}, {weight.n}]: {weight.tiles.size} tile bytes do not fit")
        self.weight = weight
        self.struct = _Weight(GGML_TYPE[weight.kind], weight.k, weight.n, 0, weight.tiles.ctypes.data)

    @property
    def k(self) -> int:
        return self.weight.k

    @property
    def n(self) -> int:
        return self.weight.n


class Activations:
    """x [M, K] quantized: int8 q, and per block of 32 its scale d and d * sum(q) (per half block too)."""

    def __init__(self, m: int, k: int) -> None:
        if k % SUB:
            raise ValueError(f"activations need K divisible by {SUB}, got {k}")
        self.q = np.empty((m, k), np.int8)
        self.d = np.empty((m, k // SUB), np.float32)
        self.ds = np.empty((m, k // SUB), np.float32)
        self.ds16 = np.empty((m, 2 * k // SUB), np.float32)
        self.struct = _Act(m, k, self.q.ctypes.data, self.d.ctypes.data, self.ds.ctypes.data, self.ds16.ctypes.data)

    @property
    def m(self) -> int:
        return self.q.shape[0]


class Kernels:
    """The library on one path (``"auto"``: the best this CPU runs) with a pool of ``threads`` threads (the caller's
    and ``threads - 1`` workers, pinned to ``cores[1:]`` when given; the caller's own thread is the caller's to pin).
    One thread at a time calls a Kernels (its pool runs one job at a time): give each engine thread its own.
    Raises KernelBuildError when the library cannot be built, ValueError when this CPU cannot run the path asked
    for."""

    def __init__(self, path: str = "auto", threads: int = 1, cores: Sequence[int] | None = None,
                 spin_us: int = DEFAULT_SPIN_US) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if cores is not None and len(cores) < threads:
            raise ValueError(f"{threads} threads need {threads} cores, got {list(cores)}")
        self.library = library_path()
        self._lib = _load(self.library)
        isa = self._lib.ssd_isa_find(path.encode())
        if not isa:
            raise ValueError(f"kernel path {path!r} does not run on this CPU (it runs: "
                             f"{', '.join(self.available_paths())}; known: auto, {', '.join(PATHS)})")
        core_array = (ctypes.c_int * threads)(*cores) if cores is not None else None
        self._pool = self._lib.ssd_pool_create(isa, threads, core_array, spin_us)
        self.threads = threads
        self.path = self._lib.ssd_pool_path(self._pool).decode()

    def available_paths(self) -> list[str]:
        return [name for name in PATHS if self._lib.ssd_isa_find(name.encode())]

    def close(self) -> None:
        if self._pool:
            self._lib.ssd_pool_destroy(self._pool)
            self._pool = None

    def __enter__(self) -> "Kernels":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:       # interpreter teardown
            pass

    def quantize(self, x: np.ndarray, into: Activations | None = None) -> Activations:
        x = np.ascontiguousarray(x, dtype=np.float32)
        m, k = x.shape
        act = into if into is not None and into.q.shape == (m, k) else Activations(m, k)
        self._lib.ssd_quantize(self._pool, x.ctypes.data, k, ctypes.byref(act.struct))
        return act

    def matmul(self, x: np.ndarray | Activations, weights: Sequence[NativeWeight],
               out: np.ndarray | None = None) -> np.ndarray:
        """[x W_1 | x W_2 | ...] for x [M, K] (float, or already quantized): [M, sum N] fp32."""
        act = x if isinstance(x, Activations) else self.quantize(x)
        for weight in weights:
            if weight.k != act.q.shape[1]:
                raise ValueError(f"activations have K = {act.q.shape[1]}, a weight takes K = {weight.k}")
        widths = [w.n for w in weights]
        total = sum(widths)
        if out is None:
            out = np.empty((act.m, total), np.float32)
        elif out.shape != (act.m, total) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be float32 C-contiguous [{act.m}, {total}], got {out.dtype} {out.shape}")
        structs = (ctypes.POINTER(_Weight) * len(weights))(*[ctypes.pointer(w.struct) for w in weights])
        offsets = (ctypes.c_int64 * len(weights))(*np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(int))
        self._lib.ssd_matmul(self._pool, len(weights), structs, ctypes.byref(act.struct), out.ctypes.data, total,
                             offsets)
        return out

    def matmul_each(self, xs: Sequence[np.ndarray], weights: Sequence[NativeWeight],
                    outs: Sequence[np.ndarray]) -> None:
        """outs[i] = xs[i] W_i for every i, in one call into the library (no Python between the products)."""
        count = len(weights)
        if not len(xs) == len(outs) == count:
            raise ValueError(f"{count} weights need {count} inputs and outputs, got {len(xs)} and {len(outs)}")
        acts = []
        for x, w, out in zip(xs, weights, outs):
            if x.dtype != np.float32 or not x.flags.c_contiguous or x.shape[1] != w.k:
                raise ValueError(f"an input must be float32 C-contiguous [M, {w.k}], got {x.dtype} {x.shape}")
            if out.shape != (x.shape[0], w.n) or out.dtype != np.float32 or not out.flags.c_contiguous:
                raise ValueError(f"an output must be float32 C-contiguous [{x.shape[0]}, {w.n}], got {out.shape}")
            acts.append(Activations(*x.shape))
        pointers = ctypes.c_void_p * count
        self._lib.ssd_matmul_each(self._pool, count,
                                  (ctypes.POINTER(_Weight) * count)(*[ctypes.pointer(w.struct) for w in weights]),
                                  pointers(*[x.ctypes.data for x in xs]),
                                  (ctypes.POINTER(_Act) * count)(*[ctypes.pointer(a.struct) for a in acts]),
                                  pointers(*[o.ctypes.data for o in outs]))

    def dequantize_column(self, weight: NativeWeight, n: int) -> np.ndarray:
        """Column ``n`` of W [K] (an embedding row of a tiled token embedding)."""
        if not 0 <= n < weight.n:
            raise ValueError(f"column {n} is outside [0, {weight.n})")
        out = np.empty(weight.k, np.float32)
        self._lib.ssd_dequantize_column(ctypes.byref(weight.struct), n, out.ctypes.data)
        return out

    def run_step(self, model: ctypes.Structure, args: ctypes.Structure) -> None:
        """One decoder step (``csrc/ssd_step.h``) on this pool: ``kernels/step.py`` fills the structures."""
        if self._lib.ssd_step(self._pool, ctypes.byref(model), ctypes.byref(args)):
            raise MemoryError("the native step could not allocate its buffers")

    def dequantize(self, weight: NativeWeight) -> np.ndarray:
        """W [K, N] fp32 from the tiles (the reference the tests hold to gguf's dequantization)."""
        out = np.empty((weight.k, weight.n), np.float32)
        self._lib.ssd_dequantize(ctypes.byref(weight.struct), out.ctypes.data, weight.n)
        return out


__all__ = ["Activations", "KernelBuildError", "Kernels", "NativeWeight", "PATHS"]
