"""Where a :class:`~ssd_trt.runtime.Generator` runs its models, fixed when a build is loaded, validated once.

One flat config (what a user, the benchmark or the Triton model passes); each field is checked here, in
``__post_init__``, and everything downstream trusts it: cores, threads, spinning, the draft's timeout, the
backend, the draft's copy component. What is left unset (None) the build decides: the Generator fills it from the
recipe once, when it loads the build (:meth:`RuntimeOptions.for_build`). How a request decodes (K, SD's tree, SSD's algorithm settings) is not
here: it comes with each call (``decoding/settings.py``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ssd_trt.engines.placement import ModelPlacement
from ssd_trt.errors import ConfigError

# ort: ONNX Runtime on CPU; trt: the TensorRT engines; torch: the torch decoder with the Triton kernel on a
# GPU with CUDA graphs (no TensorRT needed; weights reloaded from the build's recorded sources; on a
# machine without a GPU it runs eagerly with the kernel in the Triton interpreter, which only tests want).
BACKENDS = ("ort", "trt", "torch")


@dataclass
class RuntimeOptions:
    """Defaults: target on core 0, draft on core 1 (the recipe's threads_per_engine each), the build's backend; the
    target's steps taken while the draft is idle run on both cores."""
    target_threads: int | None = None       # None: the recipe's engine.threads_per_engine
    draft_threads: int | None = None        # None: the recipe's engine.threads_per_engine
    target_cores: tuple[int, ...] | None = (0,)
    draft_cores: tuple[int, ...] | None = (1,)
    spin: bool | None = None                # ORT thread-pool spinning; None: off when the models share cores
    backend: str | None = None              # None: the build's (TensorRT when usable, else ONNX Runtime)
    draft_timeout_s: float = 60.0           # a draft call that takes longer is abandoned (SSD)
    draft_copy: bool = True                 # use the draft's copy component when its config has one
    # the CPU engine on ssd-trt's own kernels where the build has a model's tiles (engines/kernel_engine.py);
    # False: ONNX Runtime's MatMulNBits graph (which refuses SD token trees on an int8 build: not row-exact)
    cpu_kernel: bool = True
    # threads of the target's steps taken while the draft is idle (prefills, AR rounds, SD's verification,
    # SSD rounds whose speculation the load policy paused), on the target's and the draft's cores. None: one
    # per core of the two; at most target_threads: never more than placed. ONNX Runtime opens two more sessions
    # of the target for them (its weights held three times; same logits, bit for bit: tests/test_embedded_pair.py).
    target_alone_threads: int | None = None
    # a tensor-parallel target's rank that takes longer for one call is hung: the call fails, every rank is killed
    # and started afresh for the next request (engines/tensor_parallel.py)
    rank_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        for name in ("target_cores", "draft_cores"):
            cores = getattr(self, name)
            if cores and available and not set(cores) <= available:
                setattr(self, name, None)   # fewer cores than asked: let the OS place the threads
        for name in ("target_threads", "draft_threads", "target_alone_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer (or None: the build's), got {value!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)} (or None for the build's choice), "
                              f"got {self.backend!r}")
        for name in ("draft_timeout_s", "rank_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be positive, got {value!r}")

    def for_build(self, threads_per_engine: int) -> "RuntimeOptions":
        """These options with what they leave to the build filled in: each model's threads from the recipe's
        ``engine.threads_per_engine``."""
        return replace(self, target_threads=self.target_threads or threads_per_engine,
                       draft_threads=self.draft_threads or threads_per_engine)

    @property
    def spinning(self) -> bool:
        """Spin-waiting pays only when a session has its cores to itself."""
        if self.spin is not None:
            return self.spin
        shared = (self.target_cores is None or self.draft_cores is None
                  or bool(set(self.target_cores) & set(self.draft_cores)))
        return not (shared and max(self.target_threads, self.draft_threads) > 1)

    @property
    def step_cores(self) -> tuple[int, ...] | None:
        """Where the thread that runs the engine step (and calls the target) runs: the target's first core. ONNX
        Runtime pins its other threads of a step to the cores after it (``engines/ort.py``); a caller left to roam
        the target's cores meets them (AR on two cores: 1-2% slower)."""
        return self.target_cores[:1] if self.target_cores else None

    @property
    def alone_cores(self) -> tuple[int, ...] | None:
        """The target's cores, then the draft's (None: either is left to the OS)."""
        if self.target_cores is None or self.draft_cores is None:
            return None
        return tuple(dict.fromkeys(self.target_cores + self.draft_cores))

    @property
    def alone_threads(self) -> int:
        if self.target_alone_threads is not None:
            return max(self.target_alone_threads, self.target_threads)
        cores = self.alone_cores
        if cores is not None:
            return len(cores)
        # left to the OS: both models' threads, but no more than this process may run on at once
        available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(self.target_threads, min(self.target_threads + self.draft_threads, available))

    def placement(self, role: str) -> ModelPlacement:
        """Where ``role`` (target | draft) runs (of options filled in by :meth:`for_build`)."""
        if self.target_threads is None or self.draft_threads is None:
            raise ConfigError("RuntimeOptions leave the threads to the build: place models with options.for_build(...)")
        if role == "target":
            return ModelPlacement(self.target_cores, self.target_threads, self.spinning, self.alone_cores,
                                  self.alone_threads)
        return ModelPlacement(self.draft_cores, self.draft_threads, self.spinning)
