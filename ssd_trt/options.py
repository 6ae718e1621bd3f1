"""How a :class:`~ssd_trt.runtime.Generator` runs: engine placement and decoding overrides, validated once.

One flat config (what a user, the benchmark or the Triton model passes); each field is checked here,
in ``__post_init__``, and everything downstream trusts it. Placement (cores, threads, spinning, the
draft's timeout, the backend) applies to both models; decoding overrides (K, SD's tree, SSD's
algorithm settings) go to the mode strategies (``decoding/modes.py``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from ssd_trt.engines.limits import MAX_DRAFT_LEN
from ssd_trt.engines.placement import ModelPlacement
from ssd_trt.errors import RequestError

# ort: ONNX Runtime on CPU; trt: the TensorRT engines; torch: the torch decoder with the Triton kernel on a
# GPU with CUDA graphs (no TensorRT needed; weights reloaded from the build's recorded sources; on a
# machine without a GPU it runs eagerly with the kernel in the Triton interpreter, which only tests want).
BACKENDS = ("ort", "trt", "torch")


@dataclass
class RuntimeOptions:
    """Defaults: target on core 0, draft on core 1 (one thread each), the build's backend and K."""
    target_threads: int = 1
    draft_threads: int = 1
    target_cores: tuple[int, ...] | None = (0,)
    draft_cores: tuple[int, ...] | None = (1,)
    spin: bool | None = None                # ORT thread-pool spinning; None: off when the models share cores
    backend: str | None = None              # None: the build's (TensorRT when usable, else ONNX Runtime)
    draft_timeout_s: float = 60.0           # a draft call that takes longer is abandoned (SSD)
    draft_copy: bool = True                 # use the draft's copy component when its config has one
    draft_len: int | None = None            # K; None = the build's default for the mode
    tree_widths: tuple[int, ...] | None = None   # sd: verify a draft tree (children per depth)
    ssd: dict[str, Any] = field(default_factory=dict)   # SaguaroConfig overrides (algorithm settings)

    def __post_init__(self) -> None:
        available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        for name in ("target_cores", "draft_cores"):
            cores = getattr(self, name)
            if cores and available and not set(cores) <= available:
                setattr(self, name, None)   # fewer cores than asked: let the OS place the threads
        for name in ("target_threads", "draft_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RequestError(f"{name} must be a positive integer, got {value!r}")
        if self.draft_len is not None and (isinstance(self.draft_len, bool) or not isinstance(self.draft_len, int)
                                           or not 1 <= self.draft_len <= MAX_DRAFT_LEN):
            raise RequestError(f"draft_len (K) must be an integer in 1..{MAX_DRAFT_LEN}, got {self.draft_len!r}")
        if self.tree_widths is not None and (not self.tree_widths or any(
                isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in self.tree_widths)):
            raise RequestError(f"tree_widths must be positive integers (children per depth), got {self.tree_widths!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise RequestError(f"backend must be one of {', '.join(BACKENDS)} (or None for the build's choice), "
                               f"got {self.backend!r}")
        if not isinstance(self.draft_timeout_s, (int, float)) or not self.draft_timeout_s > 0:
            raise RequestError(f"draft_timeout_s must be positive, got {self.draft_timeout_s!r}")
        from ssd_trt.decoding.saguaro import SaguaroConfig
        known = {f.name for f in fields(SaguaroConfig)} - {"draft_len"}
        unknown = sorted(set(self.ssd) - known)
        if unknown:
            raise RequestError(f"unknown SSD option in {unknown}; known: {', '.join(sorted(known))} (K is "
                               f"draft_len, an option of its own)")
        SaguaroConfig(**{"draft_len": self.draft_len or 1, "fan_out_budget": MAX_DRAFT_LEN + 1, **self.ssd})

    @property
    def spinning(self) -> bool:
        """Spin-waiting pays only when a session has its cores to itself."""
        if self.spin is not None:
            return self.spin
        shared = (self.target_cores is None or self.draft_cores is None
                  or bool(set(self.target_cores) & set(self.draft_cores)))
        return not (shared and max(self.target_threads, self.draft_threads) > 1)

    def placement(self, role: str) -> ModelPlacement:
        """Where ``role`` (target | draft) runs."""
        if role == "target":
            return ModelPlacement(self.target_cores, self.target_threads, self.spinning, self.draft_timeout_s)
        return ModelPlacement(self.draft_cores, self.draft_threads, self.spinning, self.draft_timeout_s)
