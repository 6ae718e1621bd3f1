"""Where one model runs on a CPU: which cores, how many ONNX Runtime threads, whether idle threads spin, and (the
target) on which cores and threads its steps run while the other model is idle.

(On a GPU the factory places the draft and the target itself: two GPUs, or two streams of one,
``device_step.place_draft_and_target``.)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelPlacement:
    cores: tuple[int, ...] | None = None    # None: let the OS place the threads
    threads: int = 1
    spin: bool = True                      # spin-waiting pays only when the model has its cores to itself
    alone_cores: tuple[int, ...] | None = None     # steps taken while the other model is idle (Engine.alone)
    alone_threads: int = 1                 # at most ``threads``: no such steps
